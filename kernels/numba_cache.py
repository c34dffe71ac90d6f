"""numba kernels that write or address the cache: slot mapping, the K/V write, block copies.

They move bytes and integers only, so every cache dtype (fp32, fp16, bf16) runs here: the caches
and token rows are seen as raw bytes (``numba_runtime.as_bytes``), one compiled signature for all
of them. Arguments are validated by ``kernels.api``; these functions trust them. The loops are
serial: a step writes a few hundred rows, far less than a thread's start-up costs.

An fp8 cache (its ``uint8`` view) stores codes, encoded by ``numba_fp8.store_codes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit

from pagedkv.kernels import numba_fp8
from pagedkv.kernels.numba_runtime import as_array, as_bytes


@njit(cache=True)
def _slot_mapping(
    tables: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, block_size: int, out: np.ndarray
) -> None:
    """``translate_slot`` per token; position ``-1`` gives slot ``-1``."""
    for t in range(positions.shape[0]):
        pos = positions[t]
        if pos < 0:
            out[t] = -1
        else:
            block_id = np.int64(tables[seq_ids[t], pos // block_size])
            out[t] = block_id * block_size + pos % block_size


@njit(cache=True)
def _store_rows(
    key: np.ndarray, value: np.ndarray, k_slots: np.ndarray, v_slots: np.ndarray, slots: np.ndarray
) -> None:
    """Row ``t`` of ``key``/``value`` (bytes) into row ``slots[t]`` of the caches; ``-1`` skips."""
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot >= 0:
            k_slots[slot, :] = key[t, :]
            v_slots[slot, :] = value[t, :]


@njit(cache=True)
def _copy_blocks(k_blocks: np.ndarray, v_blocks: np.ndarray, pairs: np.ndarray) -> None:
    """Block ``src`` over block ``dst`` (bytes), pair after pair, in order."""
    for i in range(pairs.shape[0]):
        src, dst = pairs[i, 0], pairs[i, 1]
        k_blocks[dst, :] = k_blocks[src, :]
        v_blocks[dst, :] = v_blocks[src, :]


def slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``reference.slot_mapping``'s contract (int64 positions and sequence ids); int64 slots."""
    out = torch.empty(positions.shape, dtype=torch.int64)
    _slot_mapping(
        as_array(block_tables.contiguous()),
        as_array(positions.contiguous()),
        as_array(seq_ids.contiguous()),
        block_size,
        as_array(out),
    )
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> None:
    """``reference.store_kv``'s contract: token ``t``'s K/V into slot ``slot_mapping[t]``; an fp8
    cache comes as its ``uint8`` view with its format's name ``fp8`` and the ``(k, v)`` scales."""
    slots = k_cache.shape[0] * k_cache.shape[1]
    if fp8 is not None and scales is not None:
        rows = (key.float().contiguous(), value.float().contiguous())
        caches = (k_cache.view(slots, *k_cache.shape[2:]), v_cache.view(slots, *v_cache.shape[2:]))
        numba_fp8.store_codes(rows, caches, slot_mapping.to(torch.int64).contiguous(), scales, fp8)
        return
    _store_rows(
        as_bytes(key.contiguous()),
        as_bytes(value.contiguous()),
        as_bytes(k_cache.view(slots, -1)),
        as_bytes(v_cache.view(slots, -1)),
        as_array(slot_mapping.to(torch.int64).contiguous()),
    )


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """``reference.copy_blocks``'s contract: the pairs in order."""
    _copy_blocks(
        as_bytes(k_cache), as_bytes(v_cache), np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    )
