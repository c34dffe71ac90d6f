"""``BlockTableStore.grow_or_preempt`` against the spec's ``append_slot`` per sequence in batch
order, each ``OutOfBlocksError`` freeing the batch's last remaining sequence: victims and the whole
state agree after every step. Subclasses add copy-source preemption and windows; planted bugs."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv.impl.blocks import (
    BlockManager,
    BlockTableStore,
    PrefixCachingBlockManager,
    admission,
    growth,
    prefix_cache,
    prefix_store,
    rows,
)
from pagedkv.impl.blocks import store as store_module
from pagedkv.spec.block_manager import BlockManager as SpecBlockManager
from pagedkv.spec.block_manager import OutOfBlocksError
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager as SpecPrefixManager
from properties.mutants import CONTROL_SEARCHES, FIND, load_copy, load_mutant, planted_store
from properties.outcomes import outcome

VOCAB = st.integers(0, 1)  # two tokens: prompts share prefixes often
REFUSED = (
    "refused is not None and refused.extra is extra "
    "and isinstance(token_ids, (list, tuple)) and list(token_ids) == refused.tokens"
)
SALTS = st.sampled_from([None, None, None, "tenant-a"])  # mostly unsalted: prefixes match often
TABLE_WIDTH = 64  # the store's max_blocks_per_seq


class PreemptionMachine(RuleBasedStateMachine):
    STORE: ClassVar[type] = BlockTableStore
    PREFIX_MANAGER: ClassVar[type] = PrefixCachingBlockManager
    seqs = Bundle("seqs")

    @initialize(
        total_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4]), prefix=st.booleans()
    )
    def start(self, total_blocks: int, block_size: int, prefix: bool) -> None:
        impl_class = self.PREFIX_MANAGER if prefix else BlockManager
        spec_class = SpecPrefixManager if prefix else SpecBlockManager
        self.spec: Any = spec_class(total_blocks, block_size)
        self.store = self.STORE(impl_class(total_blocks, block_size), 8, TABLE_WIDTH)
        self.prefix, self.block_size = prefix, block_size
        self.model: dict[int, tuple[list[int], list[int]]] = {}  # id -> (table, tokens)
        self.salt_of: dict[int, str | None] = {}  # the salt each sequence was admitted with
        self.next_id = 0

    @precondition(lambda self: len(self.model) < 8)
    @rule(target=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=12))
    def add(self, tokens: list[int]) -> Any:
        seq_id = self.next_id
        try:
            table, _ = self.spec_allocate(tokens, None)
        except OutOfBlocksError:
            before = self.store.num_free_blocks  # an AssertionError, which a planted bug's
            # search counts as a catch (pytest.raises' own failure is no Exception)
            assert outcome(self.store.add_prompt, seq_id, tokens) == ("raised", OutOfBlocksError)
            assert self.store.num_free_blocks == before
            return multiple()
        self.store.add_prompt(seq_id, tokens)
        return self.record(table, tokens, None)

    def spec_allocate(self, tokens: list[int], salt: str | None) -> tuple[list[int], int]:
        """The spec's table for a prompt, and its cached tokens."""
        if self.prefix:
            return self.spec.allocate_prompt(tokens, salt)  # type: ignore[no-any-return]
        return self.spec.allocate(self.blocks_needed(tokens, salt)), 0

    def blocks_needed(self, tokens: list[int], salt: str | None) -> int:
        if self.prefix:
            return self.spec.blocks_to_allocate(tokens, salt)  # type: ignore[no-any-return]
        return -(-len(tokens) // self.block_size)

    def record(self, table: list[int], tokens: list[int], salt: str | None) -> int:
        """A new live sequence in the model; its id."""
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.model[seq_id], self.salt_of[seq_id] = (table, list(tokens)), salt
        return seq_id

    @precondition(lambda self: len(self.model) < 8)
    @rule(target=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=12), headroom=st.integers(0, 3),
          salt=SALTS, retry=st.sampled_from(["same", "other tokens", "other salt"]))  # fmt: skip
    def admit(self, tokens: list[int], headroom: int, salt: str | None, retry: str) -> Any:
        """``admit``; a refused one retried after a cache change reuses keys for the same prompt."""
        seq_id = self.next_id
        for attempt in range(2):
            headroom = 0 if attempt else headroom
            if attempt and retry == "other tokens":
                tokens = [1 - token for token in tokens]
            elif attempt and retry == "other salt":
                salt = "tenant-b" if salt is None else None
            fits = self.spec.num_free_blocks - self.blocks_needed(tokens, salt) >= headroom
            cached = self.store.admit(seq_id, tokens, headroom, salt)
            if fits:
                break
            assert cached is None
            for other, (table, keyed) in list(self.model.items())[:1]:
                if self.prefix:  # the cache changes between the two tries
                    other_salt = self.salt_of.get(other)
                    self.store.cache_blocks(other, keyed, other_salt)
                    self.spec.cache_blocks(table, keyed, other_salt)
        if not fits:
            return multiple()
        table, spec_cached = self.spec_allocate(tokens, salt)
        assert cached == spec_cached
        return self.record(table, tokens, salt)

    @precondition(lambda self: self.prefix and 0 < len(self.model) < 8)
    @rule(target=seqs, data=st.data(), retry=st.sampled_from(["other tokens", "other salt"]))
    def retry_a_cached_prompt(self, data: st.DataObject, retry: str) -> Any:
        """A live sequence's tokens, its blocks registered: refused for headroom, then retried
        with other tokens or under another salt, whose keys must be planned anew."""
        seq = data.draw(st.sampled_from(list(self.model)), label="seq")
        self.register(seq)
        tokens, salt = self.model[seq][1], self.salt_of.get(seq)
        return self.admit(tokens, self.spec.num_free_blocks + 1, salt, retry)

    @precondition(lambda self: len(self.model) < 8)
    @rule(target=seqs, parent=seqs)
    def fork(self, parent: int) -> Any:
        if parent not in self.model:
            return multiple()
        table, tokens = self.model[parent]
        self.store.fork(parent, self.next_id)
        return self.record(self.spec.fork(table), tokens, self.salt_of.get(parent))

    @precondition(lambda self: self.prefix and len(self.model) < 7)
    @rule(target=seqs, tokens=st.lists(VOCAB, min_size=1, max_size=12))
    def twins(self, tokens: list[int]) -> Any:
        """Two sequences admitted with one prompt before either registers hold its tokens in
        blocks of their own: the second's keys are taken (left uncached), the first leaves, and
        a later registration of the second retries them once the first's blocks are evicted."""
        twins = [self.add(tokens) for _ in range(2)]
        if not all(isinstance(seq, int) for seq in twins):
            return multiple(*(seq for seq in twins if isinstance(seq, int)))
        for seq in twins:
            self.register(seq)
        self.remove(twins[0])
        return twins[1]

    @rule(seq=consumes(seqs))
    def remove(self, seq: int) -> None:
        if seq in self.model:
            self.spec.free(self.model.pop(seq)[0])
            self.store.remove([seq])

    @rule(seq=seqs)
    def register(self, seq: int) -> None:
        if seq in self.model and self.prefix:
            table, tokens = self.model[seq]
            salt = self.salt_of.get(seq)
            got = outcome(self.store.cache_blocks, seq, tokens, salt)
            assert got == outcome(self.spec.cache_blocks, table, tokens, salt)

    @rule()
    def pop_copy_pairs(self) -> None:
        assert self.store.pop_copy_pairs().tolist() == [list(p) for p in self.spec.pop_copy_pairs()]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), decode=st.booleans())
    def grow_or_preempt(self, data: st.DataObject, decode: bool) -> None:
        """Every live sequence in the order added, by one token (decode) or drawn counts."""
        ids = list(self.model)
        steps = [1] * len(ids) if decode else [data.draw(st.integers(0, 5)) for _ in ids]
        self.grow_all(ids, steps, decode)

    def grow_all(self, ids: list[int], steps: list[int], decode: bool = False) -> None:
        """``grow_or_preempt`` of ``ids`` by ``steps`` (one int for a decode step), each capped
        at what its table's ``TABLE_WIDTH`` entries hold, against the spec."""
        room = [TABLE_WIDTH * self.block_size - len(self.model[s][1]) for s in ids]
        capped = [min(step, left) for step, left in zip(steps, room, strict=True)]
        decode = decode and capped == steps
        victims = self.store.grow_or_preempt(ids, 1 if decode else capped)
        assert victims == self.expected_victims(ids, capped)

    def expected_victims(self, ids: list[int], steps: list[int]) -> list[int]:
        """The spec, one call at a time; updates the model."""
        remaining = list(ids)
        victims: list[int] = []
        for seq_id, k in zip(ids, steps, strict=True):
            if seq_id not in remaining:
                break
            while True:
                table, tokens = self.model[seq_id]
                try:
                    table = self.spec.append_slot(table, len(tokens) + k, new_tokens=k)
                except OutOfBlocksError:
                    victim = remaining.pop()
                    self.spec.free(self.model.pop(victim)[0])
                    victims.append(victim)
                    if victim == seq_id:
                        return victims
                    continue
                self.model[seq_id] = (table, tokens + [seq_id % 2] * k)
                break
        return victims

    @invariant()
    def agrees(self) -> None:
        store = self.store
        assert set(store.seq_ids) == set(self.model)
        for seq_id, (table, tokens) in self.model.items():
            assert store.table(seq_id) == table
            assert store.token_count(seq_id) == len(tokens)
        manager = store.manager
        assert manager.free_block_ids() == self.spec.free_block_ids()
        assert manager.ref_counts().tolist() == [b.ref_count for b in self.spec.blocks]
        pairs = self.spec.pending_copy_pairs()
        assert store.pending_copy_pairs().tolist() == [list(pair) for pair in pairs]
        assert manager.waiting_for_copy == self.spec.waiting_for_copy
        if self.spec.waiting_for_copy:
            event("a preempted copy source waits for its copy")
        if self.prefix:
            for block in range(manager.total_blocks):
                assert manager.key_of(block) == self.spec.key_of(block)


TestPreemption = PreemptionMachine.TestCase


class CopySourcePreemptionMachine(PreemptionMachine):
    @precondition(lambda self: 0 < len(self.model) < 8)
    @rule(data=st.data())
    def fork_then_preempt_the_child(self, data: st.DataObject) -> None:
        """Fork; the parent copies, the child is preempted: the source waits (docs/design.md §5)."""
        parent = data.draw(st.sampled_from(list(self.model)), label="parent")
        self.fork(parent)
        ids = list(self.model)  # the child is the last: the first victim
        steps = [1 if s == parent else data.draw(st.integers(0, 8)) for s in ids[:-1]] + [1]
        self.grow_all(ids, steps)


TestCopySourcePreemption = CopySourcePreemptionMachine.TestCase


class WindowPreemptionMachine(PreemptionMachine):
    @precondition(lambda self: self.model)
    @rule(data=st.data(), window=st.integers(1, 9))
    def release_outside_window(self, data: st.DataObject, window: int) -> None:
        """Every live sequence releases at its token count or an earlier position."""
        counts = None
        if data.draw(st.booleans(), label="earlier positions"):
            counts = [data.draw(st.integers(0, len(tokens)), label="position")
                      for _, tokens in self.model.values()]  # fmt: skip
        self.release_all(window, counts)

    @precondition(lambda self: self.model)
    @rule(window=st.integers(1, 4), decode=st.booleans(), data=st.data())
    def window_step(self, window: int, decode: bool, data: st.DataObject) -> None:
        """The scheduler's step under a window: release, then grow (preempting)."""
        self.release_all(window)
        self.grow_or_preempt(data, decode)

    def release_all(self, window: int, counts: list[int] | None = None) -> list[int]:
        """Every live sequence releases at ``counts`` (None: the store's default, its token
        count), in the store and the model."""
        ids = list(self.model)
        self.store.release_outside_window(ids, window, *([] if counts is None else [counts]))
        counts = [len(self.model[s][1]) for s in ids] if counts is None else counts
        for seq_id, count in zip(ids, counts, strict=True):
            table, tokens = self.model[seq_id]
            self.model[seq_id] = (self.spec.release_outside_window(table, count, window), tokens)
        return ids

    @precondition(lambda self: self.model)
    @rule(window=st.integers(1, 4), step=st.integers(2, 8))
    def window_step_under_pressure(self, window: int, step: int) -> None:
        """Release, then grow every sequence by ``step`` tokens: the pool runs short, and a
        victim's released entries free nothing."""
        ids = self.release_all(window)
        self.grow_all(ids, [step] * len(ids))


TestWindowPreemption = WindowPreemptionMachine.TestCase


M, C, W = PreemptionMachine, CopySourcePreemptionMachine, WindowPreemptionMachine
PLANTED: dict[str, tuple[type[PreemptionMachine], Any, str, str, str]] = {
    # bug: (the machine that catches it, module, scope, old, new)
    "victims are taken from the head": (M, growth, "preemption_plan",
        "removed = list(range(n - 1, stop - 1, -1))", "removed = list(range(n - stop))"),
    "the batched plan forgets that a victim may be the sequence itself": (M, growth,
        "preemption_stop", "cut = np.arange(n) + victims >= n", "cut = np.arange(n) + victims > n"),
    "a shared prefix block counts as freed": (M, growth, "plan_in_order", "left == 0", "True"),
    "victims are freed first-block-first": (M, rows, "SeqRows.release",
        "reversed_tables = self.tables[rows, ::-1]", "reversed_tables = self.tables[rows]"),
    "incremental registration never retries a block left uncached": (M, prefix_store,
        "PrefixStore.register", "indices = [i for i in state.retry if i >= released]",
        "indices = []"),
    "extended keys restart the chain": (M, prefix_cache,
        "PrefixCachingBlockManager.extend_block_keys", "parent = keys[-1] if keys else None",
        "parent = None"),
    "a refused prompt's keys are reused for another prompt": (M, prefix_store,
        "PrefixStore.keys_if_refused", REFUSED,
        REFUSED.replace(" and list(token_ids) == refused.tokens", "")),
    "a refused prompt's keys are reused under another salt": (M, prefix_store,
        "PrefixStore.keys_if_refused", REFUSED, REFUSED.replace(" and refused.extra is extra", "")),
    "admit ignores the salt": (M, admission, "Admission.admit",
        "self.prefix.plan(token_ids, extra_key, retry=True)",
        "self.prefix.plan(token_ids, None, retry=True)"),
    "the decode fast path ignores a forked last block": (M, growth, "decode_plan",
        "rows.tail_shared.take(batch_rows).any()", "False"),
    "a preemption plan counts a source waiting for its copy as free": (C, growth,
        "plan_in_order", "free += left == 0 and block not in sources", "free += left == 0"),
    "a victim's released entries count as freed blocks": (W, growth, "preemption_plan",
        "held_counts = g.lengths - rows.num_released.take(g.rows)", "held_counts = g.lengths"),
    "a victim shared with others releases its released entries too": (W, growth,
        "plan_in_order", "rows.held(int(g.rows[victim]))",
        "rows.tables[int(g.rows[victim]), : g.lengths[victim]]"),
    "cache_blocks registers a released entry": (W, store_module, "BlockTableStore.cache_blocks",
        "count, released = int(rows.token_counts[row]), int(rows.num_released[row])",
        "count, released = int(rows.token_counts[row]), 0"),
}  # fmt: skip
CONTROLS = [  # identity "mutations": the loading paths are sound
    (M, store_module, "BlockTableStore.grow", "atomic and failed"),
    (M, growth, "plan_in_order", "left == 0"),
    (M, prefix_store, "PrefixStore.admit", "self.refused = None"),
    PLANTED["extended keys restart the chain"][:4],
    (W, store_module, "BlockTableStore.grow", "atomic and failed"),
]


def planted_machine(
    base: type[PreemptionMachine], module: Any, within: str, old: str, new: str
) -> type:
    """``base`` over the store (and prefix manager) with ``old -> new`` planted in ``module``."""
    if module is prefix_cache:
        prefix = load_mutant(module, within, old, new, ("BlockTableError",))
        store = load_copy(store_module, ("CapacityError",), using={module.__name__: prefix})
        attrs = {"PREFIX_MANAGER": prefix.PrefixCachingBlockManager, "STORE": store.BlockTableStore}
    else:
        attrs = {"STORE": planted_store(module, within, old, new)}
    return type("PlantedPreemption", (base,), attrs)


@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copies_pass(search: settings) -> None:
    for base, module, within, snippet in CONTROLS:
        machine = planted_machine(base, module, within, snippet, snippet)
        run_state_machine_as_test(machine, settings=search)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_preemption_bug_is_caught(bug: str) -> None:
    machine = planted_machine(*PLANTED[bug])  # loading errors are not catches
    with pytest.raises(Exception):  # noqa: B017 - an assertion or a crash inside a rule
        run_state_machine_as_test(machine, settings=FIND)
