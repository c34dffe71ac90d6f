"""A batch's block tables in the layouts attention kernels read, as numpy int32 arrays.

Each function reads a :class:`~pagedkv.impl.blocks.store.BlockTableStore` through its
public, read-only views and changes nothing. ``seqs`` is what the store's methods take: a
``SeqBatch``, a list, tuple or 1-D integer array of live ids, or ``None`` for every live
sequence in the order added. ``torch.from_numpy`` turns a result into a tensor without a copy.

Entries a sliding window released (``BlockTableStore.release_outside_window``) stay in place as
``PAD`` (-1) in every layout, so logical block ``i`` is still entry ``i`` of its sequence; they
lie wholly before the window of the sequence's next query, and a kernel reading the layout with
that window must never read them (this project's kernels start at the window).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.rows import SeqBatch, SeqIds
from pagedkv.impl.blocks.store import BlockTableStore

Int32Array = NDArray[np.int32]


def block_tables(store: BlockTableStore, seqs: SeqBatch | SeqIds | None = None) -> Int32Array:
    """The batch's tables as a new ``[batch, max_blocks_per_seq]`` array, ``PAD`` (-1) padded."""
    return store.tables.take(store.resolve(seqs).rows, axis=0)


def context_lens(store: BlockTableStore, seqs: SeqBatch | SeqIds | None = None) -> Int32Array:
    """The batch's token counts, ``[batch]``."""
    return store.token_counts.take(store.resolve(seqs).rows)


def flash_attention_page_table(
    store: BlockTableStore, seqs: SeqBatch | SeqIds | None = None
) -> tuple[Int32Array, Int32Array]:
    """FlashAttention's paged-KV arguments: ``(block_table, cache_seqlens)``.

    ``block_table`` is ``[batch, max_blocks_per_seq]`` (entries past a sequence's blocks are -1
    and never read); ``cache_seqlens`` is ``[batch]``.
    """
    rows = store.resolve(seqs).rows
    return store.tables.take(rows, axis=0), store.token_counts.take(rows)


def flashinfer_page_table(
    store: BlockTableStore, seqs: SeqBatch | SeqIds | None = None
) -> tuple[Int32Array, Int32Array, Int32Array]:
    """FlashInfer's CSR page table: ``(kv_indptr, kv_indices, kv_last_page_len)``.

    Sequence ``i``'s pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, its table
    (released entries ``PAD``); its last page holds ``kv_last_page_len[i]`` tokens (in
    ``1..block_size``; 0 for no page).
    """
    rows = store.resolve(seqs).rows
    lengths = store.num_blocks[rows]
    indptr = np.zeros(rows.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=indptr[1:])
    tables = store.tables[rows]
    indices = tables[np.arange(store.max_blocks_per_seq) < lengths[:, None]]
    counts = store.token_counts[rows]
    last_page_len = np.where(lengths > 0, counts - (lengths - 1) * store.block_size, 0)
    return indptr, indices, last_page_len.astype(np.int32)
