"""Stable block keys (the same hash under any ``PYTHONHASHSEED``), cache salts from
``add_request`` to the store isolating tenants, and KV events rebuilding an engine's key map."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pagedkv.impl.serving.scheduler as scheduler_module
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig
from pagedkv.spec.prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager as SpecPrefixManager
from properties.engine_cases import MODEL, single_thread  # noqa: F401 - an autouse fixture
from properties.mutants import load_mutant
from properties.test_prefix_cache_spec import GOLDEN_SALTED
from properties.test_prefix_cache_spec import KEY_PROMPT as PROMPT

ROOT = Path(__file__).resolve().parent.parent
KEYED = (PROMPT, "tenant-a", ("lora", 7))  # tokens, salt, a tuple extra key
FULL = (len(PROMPT) - 1) // 4 * 4  # the tokens of every block before the last token's

HASHES_SCRIPT = """
import json, sys
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager
tokens, salt, extra = json.loads(sys.argv[1])
manager = PrefixCachingBlockManager(8, 4)
print(json.dumps({
    "salted": [key.hash_value for key in manager.block_keys(tokens, salt)],
    "tuple extra": [key.hash_value for key in manager.block_keys(tokens, tuple(extra))],
    "python hash of the salt": hash(salt),
}))
"""


def hashes_in_a_new_process(seed: str, tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", HASHES_SCRIPT, json.dumps(KEYED)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_block_hashes_are_the_same_in_every_process(tmp_path: Path) -> None:
    first = hashes_in_a_new_process("1", tmp_path)
    second = hashes_in_a_new_process("2", tmp_path)
    assert first["python hash of the salt"] != second["python hash of the salt"]  # or no test
    here = SpecPrefixManager(8, 4)
    for result in (first, second):
        assert result["salted"] == [k.hash_value for k in here.block_keys(PROMPT, "tenant-a")]
        assert result["tuple extra"] == [k.hash_value for k in here.block_keys(PROMPT, ("lora", 7))]
    assert first["salted"] == GOLDEN_SALTED  # impl's: test_prefix_cache_spec on impl


# ----------------------------------------------------------------- salts through the scheduler


def run_prompt(scheduler: Scheduler, request_id: int, salt: str | None) -> int:
    """Admit, compute and finish ``PROMPT`` under ``salt``; its cached tokens."""
    seq = scheduler.add_request(request_id, PROMPT, max_new_tokens=1, cache_salt=salt)
    out = scheduler.schedule()
    (item,) = [item for item in out.items() if item.seq is seq]
    scheduler.update(out, [0])
    assert not scheduler.has_unfinished()
    return item.cached_tokens


def salt_scheduler(module: object = scheduler_module) -> Scheduler:
    store = BlockTableStore(PrefixCachingBlockManager(64, 4), 4, 8)
    return module.Scheduler(store, SchedulerConfig(max_num_seqs=4))  # type: ignore[attr-defined]


def check_salts_isolate_tenants(scheduler: Scheduler) -> None:
    assert run_prompt(scheduler, 0, "tenant-a") == 0
    assert run_prompt(scheduler, 1, None) == 0, "an unsalted request hit a salted block"
    assert run_prompt(scheduler, 2, "tenant-b") == 0, "a salted request hit another's block"
    for request_id, salt in enumerate(["tenant-a", None, "tenant-b"], start=3):
        assert run_prompt(scheduler, request_id, salt) == FULL, f"{salt} missed its own blocks"


def test_salts_isolate_tenants_through_the_scheduler() -> None:
    check_salts_isolate_tenants(salt_scheduler())


def test_a_scheduler_that_drops_the_salt_is_caught() -> None:
    mutant = load_mutant(
        scheduler_module, "Scheduler._admit",
        "return self.store.admit(seq.seq_id, seq.tokens, headroom, seq.cache_salt)",
        "return self.store.admit(seq.seq_id, seq.tokens, headroom)", ("RequestTooLargeError",),
    )  # fmt: skip
    with pytest.raises(AssertionError, match="a salted request hit another's block"):
        check_salts_isolate_tenants(salt_scheduler(mutant))


@pytest.mark.parametrize("salt", [1, b"x", ("a",)])
def test_a_salt_that_is_not_a_str_is_refused(salt: object) -> None:
    scheduler = salt_scheduler()
    with pytest.raises(TypeError, match="cache_salt"):
        scheduler.add_request(0, PROMPT, 1, cache_salt=salt)  # type: ignore[arg-type]
    assert not scheduler.has_unfinished()


def test_a_str_subclass_salt_is_the_str_it_equals() -> None:
    """A ``numpy.str_`` salt is the plain str (it once wedged the default hash): same blocks (the
    engine serves it so: test_type_zoo's add_request zoo)."""
    scheduler = salt_scheduler()
    seq = scheduler.add_request(0, PROMPT, 1, cache_salt=np.str_("tenant-a"))
    assert type(seq.cache_salt) is str
    scheduler.update(scheduler.schedule(), [0])
    assert not scheduler.has_unfinished()
    assert run_prompt(scheduler, 1, "tenant-a") == FULL
    assert run_prompt(scheduler, 2, "tenant-b") == 0


# ----------------------------------------------------------------- the engine's events and reset


def test_engine_events_rebuild_the_cache_and_reset_waits_for_idle() -> None:
    engine = PagedAttentionEngine(
        MODEL, total_blocks=12, block_size=4, max_num_seqs=2,
        enable_prefix_caching=True, enable_kv_events=True,
    )  # fmt: skip
    mirror: dict[object, int] = {}

    def replay() -> None:
        for item in engine.take_kv_events():
            if isinstance(item, BlockStored):
                mirror[item.key] = item.block_id
            elif isinstance(item, BlockRemoved):
                assert mirror.pop(item.key) == item.block_id
            else:
                assert isinstance(item, AllBlocksCleared)
                mirror.clear()

    def cached() -> dict[object, int]:
        manager = engine.store.manager
        keys = {b: manager.key_of(b) for b in range(manager.total_blocks)}
        return {key: block for block, key in keys.items() if key is not None}

    prompts = [PROMPT, [*PROMPT[:9], 0, 0, 0, 0, 0], [7] * 13, PROMPT]
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=6, cache_salt="tenant-a")
    evicted = False
    while engine.has_unfinished_requests():
        engine.step()
        if engine.kv_cache_usage > 0:  # some request holds blocks
            assert engine.reset_prefix_cache() is False
        replay()
        assert mirror == cached()
        evicted = evicted or engine.store.prefix_cache_stats.evictions > 0
    assert evicted and mirror, "the workload must store and evict blocks"
    assert engine.kv_cache_usage == 0.0
    stats = engine.take_prefix_cache_stats()
    assert stats is not None and stats.hit_blocks > 0
    assert engine.take_prefix_cache_stats() == type(stats)()  # read: started again at zero
    assert engine.reset_prefix_cache() is True
    replay()
    assert mirror == cached() == {}


def test_a_store_admit_under_an_unstable_extra_key_changes_nothing() -> None:
    """``admit`` builds every key first: an unstable extra key is a TypeError changing nothing."""
    store = BlockTableStore(PrefixCachingBlockManager(16, 4, enable_kv_events=True), 4, 8)
    store.admit(0, PROMPT, 0, "tenant-a")
    store.cache_blocks(0, PROMPT, "tenant-a")
    tables, free, _ = store.tables.tolist(), store.manager.free_block_ids(), store.take_kv_events()
    with pytest.raises(TypeError, match="extra_key"):
        store.admit(1, PROMPT, 0, frozenset({"tenant-a"}))
    assert store.tables.tolist() == tables and store.manager.free_block_ids() == free
    assert store.take_kv_events() == []
    assert store.seq_ids == (0,)
    assert store.admit(1, PROMPT, 0, "tenant-a") == 12  # its three full blocks hit
