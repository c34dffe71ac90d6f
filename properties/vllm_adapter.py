"""vLLM's v1 ``KVCacheManager`` (in ``.venv-vllm`` only) driven through the spec's operations:
:class:`VllmKVCache` wraps one manager (one full-attention group) in spec terms, through the
mappings of :data:`properties.vllm_rules.DIVERGENCES` only, and reads its state unchanged."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.spec.block_manager import OutOfBlocksError
from properties.vllm_rules import Content

ROOT = Path(__file__).resolve().parent.parent


# vLLM imported with the root off sys.path: transformers probes (once) for Hugging Face's
# ``kernels``, which the root's ``kernels/`` would shadow.
_saved = list(sys.path)
sys.path[:] = [entry for entry in _saved if Path(entry or ".").resolve() != ROOT]
try:
    import vllm.v1.core.kv_cache_manager  # noqa: F401
finally:
    sys.path[:] = _saved

import torch  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

MAX_MODEL_LEN = 1 << 20  # vLLM's cap on a request's tokens, far beyond anything driven here
HashFn = Callable[[Any], bytes]


def to_spec_id(vllm_id: int) -> int:
    """``NULL_BLOCK``: vLLM's block ``i`` is the spec's block ``i - 1`` (vLLM's 0 is reserved)."""
    return vllm_id - 1


def make_manager(
    total_blocks: int, block_size: int, caching: bool, observed: bool = False
) -> KVCacheManager:
    """``total_blocks`` usable blocks (``NULL_BLOCK``), one full-attention group, hashed every
    ``block_size`` tokens (``HASH_GRANULARITY``); ``observed``: counters and KV events on."""
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    group = KVCacheGroupSpec(["layer"], attention)
    return KVCacheManager(
        KVCacheConfig(num_blocks=total_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[group]),
        max_model_len=MAX_MODEL_LEN, scheduler_block_size=block_size, hash_block_size=block_size,
        enable_caching=caching, log_stats=observed, enable_kv_cache_events=observed,
    )  # fmt: skip


def request_factory(
    block_size: int, caching: bool, hash_fn: HashFn = sha256
) -> Callable[[str, list[int], str | None], Request]:
    """``make(request_id, prompt, salt)``: a vLLM ``Request`` hashed every ``block_size`` tokens
    with ``hash_fn`` when ``caching``. Seeds vLLM's first-block hash (process-wide)."""
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn) if caching else None
    sampling = SamplingParams(max_tokens=MAX_MODEL_LEN)

    def make(request_id: str, prompt: list[int], salt: str | None = None) -> Request:
        return Request(request_id, prompt, sampling, None, block_hasher=hasher, cache_salt=salt)

    return make


class VllmKVCache:
    """One vLLM ``KVCacheManager`` in spec block ids; ``hash_fn``: vLLM's block hash (sha256:
    deterministic across runs), ``to_spec``: vLLM id to spec id (a planted bug passes another)."""

    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        caching: bool,
        hash_fn: HashFn = sha256,
        to_spec: Callable[[int], int] = to_spec_id,
    ) -> None:
        self.make_request = request_factory(block_size, caching, hash_fn)
        self.block_size = block_size
        self.to_spec = to_spec
        self.manager = make_manager(total_blocks, block_size, caching, observed=True)
        self.pool = self.manager.block_pool
        self.content_of_hash: dict[bytes, Content] = {}
        self.content_of_external: dict[object, Content] = {}
        self.router: Counter[Content] = Counter()  # KV events: stored minus removed, per content
        self.removed = 0  # hashes in BlockRemoved events
        self._serial = 0

    def _request(self, tokens: Sequence[int], salt: str | None) -> Request:
        """A vLLM request for ``tokens``, its block hashes remembered by content."""
        self._serial += 1
        request = self.make_request(f"r{self._serial}", list(tokens), salt)
        self._learn_hashes(request)
        return request

    def _learn_hashes(self, request: Request) -> None:
        tokens, salt = list(request.all_token_ids), request.cache_salt
        for index, block_hash in enumerate(request.block_hashes):
            content = (salt, tuple(tokens[: (index + 1) * self.block_size]))
            # under a collision the first content keeps the hash: the second is checked against it
            self.content_of_hash.setdefault(block_hash, content)
            self.content_of_external.setdefault(maybe_convert_block_hash(block_hash), content)

    def ids(self, blocks: Sequence[Any]) -> list[int]:
        return [self.to_spec(block.block_id) for block in blocks]

    def lookup(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        """The blocks ``get_computed_blocks`` would reuse for this prompt, changing nothing."""
        blocks, _, _ = self.manager.get_computed_blocks(self._request(tokens, salt))
        return self.ids(blocks.blocks[0]) if blocks.blocks else []

    def admit(self, tokens: Sequence[int], salt: str | None) -> tuple[Request, int]:
        """Look up, allocate, register: the handle and cached tokens (``NONE_ON_EXHAUSTION``)."""
        request = self._request(tokens, salt)
        computed, hit_tokens, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, len(tokens) - hit_tokens, hit_tokens, computed)
        if new is None:
            raise OutOfBlocksError(f"vLLM cannot allocate a prompt of {len(tokens)} tokens")
        self.manager.record_prefix_cache_stats(request, hit_tokens)
        request.num_computed_tokens = len(tokens)
        request.status = RequestStatus.RUNNING
        return request, hit_tokens

    def decode(self, request: Request, token: int) -> None:
        """Append a token and ``allocate_slots(request, 1)`` (registering a block it fills); with
        no block free, ``OutOfBlocksError`` and the token taken back, the manager unchanged."""
        computed = request.num_computed_tokens
        request.append_output_token_ids(token)
        self._learn_hashes(request)
        if self.manager.allocate_slots(request, 1) is None:
            request._all_token_ids.pop()
            request._output_token_ids.pop()
            del request.block_hashes[request.num_tokens // self.block_size :]
            raise OutOfBlocksError("vLLM cannot allocate a decode slot")
        request.num_computed_tokens = computed + 1

    def free(self, request: Request) -> None:
        """``KVCacheManager.free``: release the request's blocks (again: a no-op)."""
        self.manager.free(request)

    def raw_table(self, request: Request) -> list[int]:
        """The request's blocks, in vLLM's own ids."""
        return [b.block_id for b in self.manager.coordinator.get_blocks(request.request_id)[0]]

    def table(self, request: Request) -> list[int]:
        return [self.to_spec(block_id) for block_id in self.raw_table(request)]

    def free_block_ids(self) -> list[int]:
        """vLLM's free queue, head first, in spec ids."""
        return self.ids(self.pool.free_block_queue.get_all_free_blocks())

    @property
    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def ref_counts(self) -> list[int]:
        """Every usable block's reference count, in spec id order."""
        return [block.ref_cnt for block in self.pool.blocks[1:]]

    def content_of(self, block_hash: Any) -> Content | None:
        """The content a block-hash key names (None for None)."""
        return None if block_hash is None else self.content_of_hash[get_block_hash(block_hash)]

    def cached_contents(self) -> dict[Content, list[int]]:
        """vLLM's hash -> block map, as content -> blocks in lookup order (spec ids)."""
        return {
            self.content_of(key): self.ids(list(b.values()) if isinstance(b, dict) else [b])
            for key, b in self.pool.cached_block_hash_to_block._cache.items()
        }

    def block_contents(self) -> list[Content | None]:
        """Each usable block's own hash, as content, in spec id order."""
        return [self.content_of(block.block_hash) for block in self.pool.blocks[1:]]

    def snapshot(self) -> tuple[object, ...]:
        """Everything observable about vLLM's manager, for "a refused call changed nothing"."""
        blocks = self.manager.coordinator.single_type_managers[0].req_to_blocks
        tables = {rid: self.ids(table) for rid, table in blocks.items()}
        state = self.free_block_ids(), self.ref_counts(), self.block_contents()
        return (*state, self.cached_contents(), tables)

    def take_events(self) -> None:
        """Drain vLLM's KV events into the router's view (``EVICTIONS_AS_EVENTS``)."""
        for event in self.manager.take_events():
            if not isinstance(event, (BlockStored, BlockRemoved)):
                raise AssertionError(f"unexpected KV event {event!r}")
            step = 1 if isinstance(event, BlockStored) else -1
            for block_hash in event.block_hashes:
                self.router[self.content_of_external[block_hash]] += step
                self.removed += step < 0

    def take_counters(self) -> tuple[int, int]:
        """vLLM's prefix-cache ``(queries, hits)`` in tokens since the last call."""
        stats = self.manager.make_prefix_cache_stats()
        assert stats is not None
        return stats.queries, stats.hits
