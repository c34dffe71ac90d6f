"""``impl.BlockTableStore`` against the spec called once per sequence.

The model is a ``spec.BlockManager`` plus each sequence's table and token count. Every batch
operation of the store must equal the spec's per-sequence calls in batch order: ``add`` is
``allocate``, ``fork`` is ``fork``, ``remove`` is ``free``, ``grow`` is ``append_slot`` with
``OutOfBlocksError`` caught (those ids are returned), ``truncate`` is ``truncate``,
``release_outside_window`` is ``release_outside_window`` (a sliding window: released entries are
the spec's ``None`` and the store's ``-1``; a write into one, or its slot, is refused with the
spec's ``BlockTableError``), and the step's copy-on-write pairs are the spec's. Every
``slot_mapping`` entry is the spec's ``translate_slot``; the FlashInfer CSR and FlashAttention
exports round-trip to the same tables and counts. Bad input raises the documented error and
changes nothing. After every step the table array (including its ``-1`` padding and the rows no
sequence holds), the free queue and every reference count agree with the model.

``STORE`` and ``PAGE_TABLES`` are class attributes so that ``test_impl_planted_bugs`` can swap in
broken copies.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv.spec.block_manager as spec_bm
import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import page_tables
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.table_store import PAD, BlockTableStore, CapacityError, SeqBatch
from properties.test_impl_differential import IntSubclass

MAX_SEQ_ID = 11
SEQ_IDS = st.integers(0, MAX_SEQ_ID)


def padded_table(table: list[int | None]) -> list[int]:
    """A spec table as the store's arrays hold it: a released entry (None) is ``PAD``."""
    return [PAD if block is None else block for block in table]


class StoreMachine(RuleBasedStateMachine):
    """A BlockTableStore on an impl manager, and the spec driven sequence by sequence."""

    STORE: ClassVar[type] = BlockTableStore
    PAGE_TABLES: ClassVar[Any] = page_tables

    @initialize(
        total_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
        max_seqs=st.integers(1, 8) | st.integers(2, 8),
        max_blocks=st.integers(1, 10),
    )
    def start(self, total_blocks: int, block_size: int, max_seqs: int, max_blocks: int) -> None:
        self.spec = spec_bm.BlockManager(total_blocks, block_size)
        self.store = self.STORE(BlockManager(total_blocks, block_size), max_seqs, max_blocks)
        self.block_size, self.max_seqs, self.max_blocks = block_size, max_seqs, max_blocks
        # seq id -> (table, token count); a table's released entries are None, as in the spec
        self.seqs: dict[int, tuple[list[int | None], int]] = {}
        self.batches: list[SeqBatch] = []

    # ----------------------------------------------------------------- helpers

    def expect_error(self, error: type[Exception], call: Any, *args: Any) -> None:
        """``call(*args)`` raises ``error`` and changes nothing."""
        before = self.snapshot()
        try:
            call(*args)
        except error:
            assert self.snapshot() == before, f"{call.__name__} raised but changed the store"
            return
        raise AssertionError(f"{call.__name__}{args} did not raise {error.__name__}")

    def snapshot(self) -> tuple[Any, ...]:
        store = self.store
        return (
            store.tables.tobytes(),
            store.num_blocks.tobytes(),
            store.token_counts.tobytes(),
            store.seq_ids,
            store.manager.free_block_ids(),
            store.manager.ref_counts().tobytes(),
        )

    def some_live(self, data: st.DataObject, min_size: int = 0) -> list[int]:
        """A batch: distinct live ids in random order."""
        ids = data.draw(st.permutations(sorted(self.seqs)), label="order")
        return ids[: data.draw(st.integers(min_size, len(ids)), label="batch size")]

    def as_batch(self, data: st.DataObject, ids: list[int]) -> Any:
        """The same ids as a list, a tuple, a numpy array, a fresh or a remembered SeqBatch."""
        kind = data.draw(st.sampled_from(["list", "tuple", "array", "batch", "old"]))
        if kind == "tuple":
            return tuple(ids)
        if kind == "array":
            return np.array(ids, dtype=np.int64)
        if kind == "batch" or (kind == "old" and not self.batches):
            batch = self.store.batch(ids)
            self.batches.append(batch)
            return batch
        for batch in self.batches:  # an old batch of exactly these ids, maybe stale
            if list(batch.seq_ids) == ids:
                return batch
        return ids

    def pairs(self) -> None:
        expected = self.spec.pop_copy_pairs()
        actual = self.store.pop_copy_pairs()
        assert actual.dtype == np.int32 and actual.shape == (len(expected), 2)
        assert [tuple(pair) for pair in actual.tolist()] == expected

    # ----------------------------------------------------------------- lifecycle

    @rule(seq_id=SEQ_IDS, data=st.data())
    def add(self, seq_id: int, data: st.DataObject) -> None:
        prompt_len = data.draw(st.integers(0, (self.max_blocks + 1) * self.block_size))
        needed = spec_bm.blocks_needed(prompt_len, self.block_size)
        if seq_id in self.seqs:
            self.expect_error(ValueError, self.store.add, seq_id, prompt_len)
        elif needed > self.max_blocks or len(self.seqs) == self.max_seqs:
            self.expect_error(CapacityError, self.store.add, seq_id, prompt_len)
        elif needed > self.spec.num_free_blocks:
            self.expect_error(spec_bm.OutOfBlocksError, self.store.add, seq_id, prompt_len)
        else:
            self.store.add(seq_id, prompt_len)
            self.seqs[seq_id] = (self.spec.allocate(needed), prompt_len)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), child=SEQ_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        if child in self.seqs:
            self.expect_error(ValueError, self.store.fork, parent, child)
        elif len(self.seqs) == self.max_seqs:
            self.expect_error(CapacityError, self.store.fork, parent, child)
        else:
            self.store.fork(parent, child)
            table, count = self.seqs[parent]
            self.seqs[child] = (self.spec.fork(table), count)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        ids = self.some_live(data)
        self.store.remove(self.as_batch(data, ids))
        for seq_id in ids:
            self.spec.free(self.seqs.pop(seq_id)[0])

    # ----------------------------------------------------------------- a step

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        """Some sequences, in any order, each by its own count or all by one."""
        ids = self.some_live(data, min_size=1)
        if data.draw(st.booleans(), label="per-sequence counts"):
            steps = data.draw(
                st.lists(st.sampled_from([0, 1, 1, 2, 3, 17]), min_size=len(ids), max_size=len(ids))
            )
            as_array = data.draw(st.booleans(), label="as array")
            self.check_grow(
                data, ids, steps, np.array(steps, dtype=np.int32) if as_array else steps
            )
        else:
            step = data.draw(st.sampled_from([0, 1, 1, 1, 2, 5]), label="k")
            self.check_grow(data, ids, [step] * len(ids), step)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """Every live sequence gains one token: the engine's common step."""
        ids = data.draw(st.permutations(sorted(self.seqs)))
        self.check_grow(data, ids, [1] * len(ids), 1)

    @precondition(lambda self: self.seqs and len(self.seqs) < self.max_seqs)
    @rule(data=st.data())
    def fork_then_decode(self, data: st.DataObject) -> None:
        """Beam search: fork, then parent and child (and maybe others) write one token each."""
        child = min(set(range(len(self.seqs) + 1)) - set(self.seqs))
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        self.store.fork(parent, child)
        table, count = self.seqs[parent]
        self.seqs[child] = (self.spec.fork(table), count)
        ids = data.draw(st.permutations(sorted(self.seqs)))
        ids = [s for s in ids if s in (parent, child) or data.draw(st.booleans())]
        self.check_grow(data, ids, [1] * len(ids), 1)

    def check_grow(
        self, data: st.DataObject, ids: list[int], steps: list[int], argument: Any
    ) -> None:
        """``grow`` equals the spec's ``append_slot`` per sequence, in order; an ``atomic`` grow
        that some sequence cannot make changes nothing."""
        batch = self.as_batch(data, ids)
        fits = all(
            spec_bm.blocks_needed(self.seqs[s][1] + k, self.block_size) <= self.max_blocks
            for s, k in zip(ids, steps, strict=True)
        )
        if not fits:
            self.expect_error(CapacityError, self.store.grow, batch, argument)
            return
        trial, seqs = copy.deepcopy(self.spec), dict(self.seqs)
        failed = []
        for seq_id, k in zip(ids, steps, strict=True):
            table, count = seqs[seq_id]
            try:
                seqs[seq_id] = (trial.append_slot(table, count + k, new_tokens=k), count + k)
            except spec_bm.OutOfBlocksError:
                failed.append(seq_id)
            except spec_bm.BlockTableError:  # a write into a released entry: the whole batch
                event("grow: a write into a released entry refused")
                self.expect_error(spec_bm.BlockTableError, self.store.grow, batch, argument)
                return
        atomic = data.draw(st.booleans(), label="atomic")
        assert self.store.grow(batch, argument, atomic=atomic) == failed
        if atomic and failed:
            return  # nothing changed: the invariants compare the store with the untouched spec
        self.spec, self.seqs = trial, seqs
        self.pairs()
        grown_ids = [(s, k) for s, k in zip(ids, steps, strict=True) if s not in failed]
        self.check_slot_mapping(data, grown_ids)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Some sequences, in any order, each back to a count it holds (or a refused one)."""
        ids = self.some_live(data)
        counts = [data.draw(st.integers(0, self.seqs[s][1]), label="count") for s in ids]
        if ids and data.draw(st.booleans(), label="bad count"):
            index = data.draw(st.integers(0, len(ids) - 1), label="which")
            bad = data.draw(st.sampled_from([-1, self.seqs[ids[index]][1] + 1, 1.0, None]))
            error = TypeError if isinstance(bad, float) or bad is None else ValueError
            self.expect_error(error, self.store.truncate, self.as_batch(data, ids), bad)
            counts[index] = bad
            self.expect_error(error, self.store.truncate, self.as_batch(data, ids), counts)
            return
        self.check_truncate(data, ids, counts)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """A speculative step: some sequences write their last token and ``k`` drafts, then
        keep ``1 + j`` of them."""
        ids = self.some_live(data, min_size=1)
        drafts = [data.draw(st.integers(0, 5), label="k") for _ in ids]
        before = {seq_id: self.seqs[seq_id][1] for seq_id in ids}
        fits = all(
            spec_bm.blocks_needed(before[s] + 1 + k, self.block_size) <= self.max_blocks
            for s, k in zip(ids, drafts, strict=True)
        )
        if not fits:
            return
        self.check_grow(data, ids, [1 + k for k in drafts], [1 + k for k in drafts])
        grown = [s for s, k in zip(ids, drafts, strict=True) if self.seqs[s][1] > before[s]]
        kept = [
            before[s] + 1 + data.draw(st.integers(0, k), label="j")
            for s, k in zip(ids, drafts, strict=True)
            if s in grown
        ]
        self.check_truncate(data, grown, kept)

    @precondition(lambda self: self.seqs and len(self.seqs) < self.max_seqs)
    @rule(data=st.data(), cut=st.integers(1, 4))
    def fork_cut_then_decode(self, data: st.DataObject, cut: int) -> None:
        """Fork, cut one of the two into the blocks they share, then decode: the cut block is
        shared and partly filled, so the next write into it must copy it."""
        child = min(set(range(len(self.seqs) + 1)) - set(self.seqs))
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        self.store.fork(parent, child)
        table, count = self.seqs[parent]
        self.seqs[child] = (self.spec.fork(table), count)
        cut_one = data.draw(st.sampled_from([parent, child]), label="cut")
        self.check_truncate(data, [cut_one], [max(0, count - cut)])
        ids = data.draw(st.permutations(sorted(self.seqs)))
        self.check_grow(data, [s for s in ids if s in (parent, child)], [1, 1], 1)

    def check_truncate(self, data: st.DataObject, ids: list[int], counts: list[int]) -> None:
        """``truncate`` equals the spec's per sequence, in order (one count or one each)."""
        uniform = len(set(counts)) == 1 and data.draw(st.booleans(), label="one count")
        batch = self.as_batch(data, ids)
        self.store.truncate(batch, counts[0] if uniform else counts)
        for seq_id, count in zip(ids, counts, strict=True):
            self.seqs[seq_id] = (self.spec.truncate(self.seqs[seq_id][0], count), count)
        self.truncated(ids, counts)

    def truncated(self, ids: list[int], counts: list[int]) -> None:
        """Hook: the sequences ``ids`` were rolled back to ``counts`` tokens."""

    def check_slot_mapping(self, data: st.DataObject, grown: list[tuple[int, int]]) -> None:
        """The step's new tokens map to the spec's slots, -1 padded."""
        ids = [s for s, _ in grown]
        counts = [k for _, k in grown]
        expected = [
            self.spec.translate_slot(self.seqs[s][0], position)
            for s, k in grown
            for position in range(self.seqs[s][1] - k, self.seqs[s][1])
        ]
        pad = data.draw(st.integers(0, 3), label="padding")
        uniform = len(set(counts)) <= 1 and data.draw(st.booleans(), label="one count")
        argument = (counts[0] if counts else 1) if uniform else counts
        if uniform and not counts:
            argument = data.draw(st.integers(0, 3))
        slots = self.store.slot_mapping(self.as_batch(data, ids), argument, len(expected) + pad)
        assert slots.dtype == np.int32
        assert slots.tolist() == expected + [-1] * pad

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def slot_mapping_any_window(self, data: st.DataObject) -> None:
        """Any ``k <= count`` tokens per sequence (a prefill is ``k == count``)."""
        ids = self.some_live(data)
        counts = [data.draw(st.integers(0, self.seqs[s][1])) for s in ids]
        try:
            expected = [
                self.spec.translate_slot(self.seqs[s][0], position)
                for s, k in zip(ids, counts, strict=True)
                for position in range(self.seqs[s][1] - k, self.seqs[s][1])
            ]
        except spec_bm.BlockTableError:  # a position in a released entry
            event("slot_mapping: a released position refused")
            batch = self.as_batch(data, ids)
            self.expect_error(spec_bm.BlockTableError, self.store.slot_mapping, batch, counts)
            return
        assert self.store.slot_mapping(self.as_batch(data, ids), counts).tolist() == expected

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def exports(self, data: st.DataObject) -> None:
        """Block tables, context lengths, FlashAttention and FlashInfer layouts of a batch."""
        if data.draw(st.booleans(), label="all"):  # None: every live sequence, in added order
            ids, batch = list(self.store.seq_ids), None
        else:
            ids = self.some_live(data)
            batch = self.as_batch(data, ids)
        tables = [self.seqs[s][0] for s in ids]
        counts = [self.seqs[s][1] for s in ids]
        padded = [padded_table(t) + [PAD] * (self.max_blocks - len(t)) for t in tables]
        layouts = self.PAGE_TABLES
        block_tables = layouts.block_tables(self.store, batch)
        assert block_tables.dtype == np.int32
        assert block_tables.reshape(len(ids), self.max_blocks).tolist() == padded
        assert layouts.context_lens(self.store, batch).tolist() == counts
        block_table, seqlens = layouts.flash_attention_page_table(self.store, batch)
        assert block_table.reshape(len(ids), self.max_blocks).tolist() == padded
        assert seqlens.tolist() == counts
        indptr, indices, last_page_len = layouts.flashinfer_page_table(self.store, batch)
        assert {indptr.dtype, indices.dtype, last_page_len.dtype} == {np.dtype(np.int32)}
        assert indptr.tolist()[0] == 0 and len(indptr) == len(ids) + 1
        for i, (table, count) in enumerate(zip(tables, counts, strict=True)):
            pages = indices[indptr[i] : indptr[i + 1]].tolist()
            assert pages == padded_table(table)  # the CSR round-trips to the spec's table
            tokens = (len(pages) - 1) * self.block_size + int(last_page_len[i]) if pages else 0
            assert pages or int(last_page_len[i]) == 0  # no page: its last page holds nothing
            assert tokens == count

    # ----------------------------------------------------------------- bad input

    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        """Unknown, repeated or non-int ids, bad counts: the documented error, nothing changes."""
        live = sorted(self.seqs)
        unknown = [s for s in range(12) if s not in self.seqs]
        store = self.store

        def block_tables(seqs: Any) -> object:
            return self.PAGE_TABLES.block_tables(store, seqs)

        def flashinfer_page_table(seqs: Any) -> object:
            return self.PAGE_TABLES.flashinfer_page_table(store, seqs)

        def truncate(seqs: Any, token_counts: Any = 0) -> object:
            return store.truncate(seqs, token_counts)

        def release(seqs: Any) -> object:
            return store.release_outside_window(seqs, 1)

        call = data.draw(
            st.sampled_from(
                [
                    store.grow,
                    store.remove,
                    store.slot_mapping,
                    block_tables,
                    flashinfer_page_table,
                    store.batch,
                    truncate,
                    release,
                ]
            )
        )
        case = data.draw(
            st.sampled_from(["unknown", "repeated", "type", "count", "too many", "seq id"])
        )
        if case == "unknown" and unknown:
            ids = data.draw(st.permutations([*live, data.draw(st.sampled_from(unknown))]))
            self.expect_error(KeyError, call, ids)
        elif case == "repeated" and live:
            ids = data.draw(st.permutations([*live, data.draw(st.sampled_from(live))]))
            self.expect_error(ValueError, call, ids)
        elif case == "type":
            bad = data.draw(st.sampled_from([True, 1.0, "1", None, np.int64(1)]))
            self.expect_error(TypeError, call, data.draw(st.permutations([*live, bad])))
            self.expect_error(TypeError, call, {1, 2})
            self.expect_error(TypeError, call, np.array([1.0]))
        elif case == "count" and live and call in (store.grow, store.slot_mapping, truncate):
            value = data.draw(st.sampled_from([-1, 1.5, True, None]))
            error = ValueError if value == -1 else TypeError
            per_seq = data.draw(st.booleans())
            argument = [1] * (len(live) - 1) + [value] if per_seq else value
            self.expect_error(error, call, live, argument)
            self.expect_error(ValueError, call, live, [1] * (len(live) + 1))  # wrong length
        elif case == "too many" and live:
            seq_id = data.draw(st.sampled_from(live))
            count = self.seqs[seq_id][1]
            self.expect_error(ValueError, store.slot_mapping, [seq_id], count + 1)
            if count:
                self.expect_error(ValueError, store.slot_mapping, [seq_id], count, count - 1)
        elif case == "seq id":
            seq_id = data.draw(st.sampled_from([True, 1.0, None, "3"]))
            self.expect_error(TypeError, store.add, seq_id, 1)
            if live:
                self.expect_error(TypeError, store.fork, live[0], seq_id)
            self.expect_error(KeyError, store.remove, [-(2**70)])

    # ----------------------------------------------------------------- invariants

    @invariant()
    def same_state(self) -> None:
        """Tables, padding, free rows, queue, reference counts and pending copy pairs agree.

        The pending pairs are read from copies, so the invariant changes nothing."""
        store = self.store
        assert sorted(store.seq_ids) == sorted(self.seqs) and len(store) == len(self.seqs)
        assert (store.max_seqs, store.max_blocks_per_seq) == (self.max_seqs, self.max_blocks)
        for seq_id in range(MAX_SEQ_ID + 1):
            assert (seq_id in store) == (seq_id in self.seqs)
        assert True not in store and "0" not in store  # only plain ints are ids
        expected_rows = np.full((self.max_seqs, self.max_blocks), -1)
        for seq_id, (table, count) in self.seqs.items():
            assert store.table(seq_id) == table
            assert store.token_count(seq_id) == count
            assert len(table) == spec_bm.blocks_needed(count, self.block_size)
            expected_rows[store.row(seq_id), : len(table)] = padded_table(table)
            assert store.num_released[store.row(seq_id)] == spec_bm.leading_released(table)
        assert store.tables.tolist() == expected_rows.tolist()  # padding and free rows are -1
        held = {store.row(s) for s in self.seqs}
        for row in range(self.max_seqs):
            if row not in held:
                assert store.num_blocks[row] == 0 and store.token_counts[row] == 0
        assert store.manager.free_block_ids() == self.spec.free_block_ids()
        assert store.manager.ref_counts().tolist() == [b.ref_count for b in self.spec.blocks]
        pending = copy.deepcopy(store).pop_copy_pairs()
        assert [tuple(pair) for pair in pending.tolist()] == copy.deepcopy(
            self.spec
        ).pop_copy_pairs()


TestBlockTableStore = StoreMachine.TestCase


class WindowStoreMachine(StoreMachine):
    """``StoreMachine`` with sliding-window releases among its steps.

    A subclass, so the searches that find the planted bugs of the base machine (and of the
    prefix store machine built on it) stay as they were; the base machine's rules already
    handle released entries (writes into them and their slots refused as by the spec).
    """

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release_outside_window(self, data: st.DataObject) -> None:
        """Sliding window: some sequences, in any order, release the blocks no query from
        their next position on reads: at their token counts (the default), or at drawn
        positions up to their tables' capacity (one for all, or one each); or a refused call."""
        window = data.draw(st.just(1) | st.integers(1, 3 * self.block_size), label="window")
        ids = self.some_live(data)
        capacity = {s: len(self.seqs[s][0]) * self.block_size for s in ids}
        kind = data.draw(st.sampled_from(["token counts", "one each", "one for all", "bad"]))
        if kind == "token counts":
            counts, argument = [self.seqs[s][1] for s in ids], None
        elif kind == "one each" or not ids:
            counts = [  # the capacity itself often: it can release a partly filled last block
                data.draw(st.just(capacity[s]) | st.integers(0, capacity[s]), label="count")
                for s in ids
            ]
            argument = data.draw(st.sampled_from([counts, np.array(counts, dtype=np.int64)]))
        elif kind == "one for all":
            argument = data.draw(st.integers(0, min(capacity.values())), label="count")
            counts = [argument] * len(ids)
        else:
            bad = data.draw(st.sampled_from(["window 0", "window 1.0", "count -1", "over", "1.0"]))
            batch, count = self.as_batch(data, ids), self.seqs[ids[0]][1]
            if bad.startswith("window"):
                self.expect_error(
                    ValueError if bad == "window 0" else TypeError,
                    self.store.release_outside_window, batch, 0 if bad == "window 0" else 1.0,
                )  # fmt: skip
            elif bad == "count -1":
                self.expect_error(ValueError, self.store.release_outside_window, batch, 1, -1)
            elif bad == "over":
                over = [count] * (len(ids) - 1) + [capacity[ids[-1]] + 1]
                self.expect_error(ValueError, self.store.release_outside_window, batch, 1, over)
            else:
                self.expect_error(
                    TypeError, self.store.release_outside_window, batch, 1, [1.0] * len(ids)
                )
            return
        released_before = sum(b is None for s in ids for b in self.seqs[s][0])
        self.store.release_outside_window(self.as_batch(data, ids), window, argument)
        for seq_id, count in zip(ids, counts, strict=True):
            table, held = self.seqs[seq_id]
            self.seqs[seq_id] = (self.spec.release_outside_window(table, count, window), held)
        released = sum(b is None for s in ids for b in self.seqs[s][0]) - released_before
        event("window: released blocks" if released else "window: nothing to release")

    @precondition(lambda self: any(count % self.block_size for _, count in self.seqs.values()))
    @rule(data=st.data())
    def release_a_partly_filled_last_block_then_decode(self, data: st.DataObject) -> None:
        """A release at a table's capacity with a window of 1 gives back even its partly
        filled last block; the next write there is refused, on the decode path too."""
        partial = sorted(s for s, (_, count) in self.seqs.items() if count % self.block_size)
        seq_id = data.draw(st.sampled_from(partial), label="sequence")
        table, count = self.seqs[seq_id]
        self.store.release_outside_window([seq_id], 1, len(table) * self.block_size)
        released = self.spec.release_outside_window(table, len(table) * self.block_size, 1)
        self.seqs[seq_id] = (released, count)
        ids = data.draw(st.permutations(sorted(self.seqs)), label="order")
        self.check_grow(data, ids, [1] * len(ids), 1)

    @precondition(lambda self: any(None in table for table, _ in self.seqs.values()))
    @rule(data=st.data())
    def finish_a_windowed_sequence(self, data: st.DataObject) -> None:
        """A sequence with released entries finishes alone (``remove``'s one-row path)."""
        windowed = sorted(s for s, (table, _) in self.seqs.items() if None in table)
        seq_id = data.draw(st.sampled_from(windowed), label="sequence")
        self.store.remove([seq_id])
        self.spec.free(self.seqs.pop(seq_id)[0])


TestWindowStore = WindowStoreMachine.TestCase


def test_stale_batch_is_resolved_again() -> None:
    """A batch made before a ``remove`` re-resolves its ids; one naming a removed id fails."""
    store = BlockTableStore(BlockManager(16, 4), 4, 4)
    for seq_id in (7, 8, 9):
        store.add(seq_id, 5)
    both, only_nine = store.batch([7, 9]), store.batch([9])
    store.remove([7])
    store.add(10, 1)  # reuses row 0, where 7 was
    assert page_tables.context_lens(store, only_nine).tolist() == [5]
    try:
        page_tables.context_lens(store, both)
    except KeyError:
        pass
    else:
        raise AssertionError("a batch naming a removed sequence must raise KeyError")


def test_other_stores_batch_is_refused() -> None:
    first = BlockTableStore(BlockManager(8, 4), 2, 2)
    second = BlockTableStore(BlockManager(8, 4), 2, 2)
    first.add(1, 1)
    second.add(1, 1)
    try:
        second.grow(first.batch([1]))
    except ValueError:
        return
    raise AssertionError("a SeqBatch of another store must be refused")


def test_the_store_shape_is_checked() -> None:
    """Row and column counts are ints >= 1, and the token counts and slot ids the store hands
    out must fit int32: typed errors naming the argument."""
    manager = BlockManager(4, 2)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_seqs"):
            BlockTableStore(manager, bad, 4)  # type: ignore[arg-type]
        with pytest.raises(error, match="max_blocks_per_seq"):
            BlockTableStore(manager, 4, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot ids"):
        BlockTableStore(BlockManager(2**16, 2**15), 1, 1)  # 2**31 slots
    with pytest.raises(ValueError, match="token counts"):
        BlockTableStore(BlockManager(4, 2**15), 1, 2**16)
    BlockTableStore(BlockManager(2**16 - 1, 2**15), 1, 2**16 - 1)  # the largest that fits
    # 2**31 - 1 is prime: only a block of that size makes a count or slot id exactly int32's
    # largest, which fits.
    store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
    store.add(0, 2**31 - 1)
    assert store.token_count(0) == 2**31 - 1
    with pytest.raises(TypeError, match="manager"):
        BlockTableStore(spec_bm.BlockManager(4, 2), 1, 1)  # type: ignore[arg-type]


def test_a_batch_is_an_immutable_value_that_shows_only_its_ids_and_rows() -> None:
    """A :class:`SeqBatch` is kept across steps, so none of its fields can be reassigned, and
    its repr is its ids and rows (not the store behind it)."""
    store = BlockTableStore(BlockManager(8, 2), 4, 4)
    store.add(5, 1)
    store.add(7, 1)
    batch = store.batch([7, 5])
    for name in ("seq_ids", "rows", "_base", "_store", "_epoch"):
        with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError
            setattr(batch, name, getattr(batch, name))
    assert repr(batch) == "SeqBatch(seq_ids=(7, 5), rows=array([1, 0]))"


def test_admit_refuses_a_prompt_longer_than_a_row() -> None:
    """Admit checks the row width before it takes a block, with or without prefix caching."""
    for manager in (BlockManager(8, 2), PrefixCachingBlockManager(8, 2)):
        store = BlockTableStore(manager, 2, 2)
        with pytest.raises(CapacityError):
            store.admit(0, [1, 2, 3, 4, 5])
        assert store.num_free_blocks == 8 and 0 not in store


def test_a_refused_prompt_retried_with_another_salt_is_planned_again() -> None:
    """Admit keeps a refused prompt's keys for a retry with the same tokens and extra key; a
    retry with another extra key (a cache salt) must not reuse them: its hits are its own."""
    manager = PrefixCachingBlockManager(8, 2)
    store = BlockTableStore(manager, 3, 4)
    prompt = [1, 2, 3, 4, 5]
    store.add_prompt(0, prompt, "a")
    store.cache_blocks(0, prompt, "a")
    assert store.admit(1, prompt, headroom=8, extra_key="b") is None  # refused: keys kept
    assert store.admit(1, prompt, extra_key="a") == 4  # salt a's two blocks hit
    assert store.table(1)[:2] == store.table(0)[:2]


def test_cache_blocks_refuses_tokens_that_are_not_a_list() -> None:
    for manager in (BlockManager(8, 2), PrefixCachingBlockManager(8, 2)):
        store = BlockTableStore(manager, 2, 4)
        store.add_prompt(0, [1, 2, 3])
        for tokens in ("123", 3, None):
            with pytest.raises(TypeError, match="token_ids"):
                store.cache_blocks(0, tokens)  # type: ignore[arg-type]


def test_cache_blocks_skips_blocks_released_before_they_were_cached() -> None:
    """A window can release a prompt's first blocks before their K/V is registered; then
    nothing is registered for them, as the spec's cache_blocks skips released entries."""
    manager = PrefixCachingBlockManager(8, 2)
    store = BlockTableStore(manager, 2, 4)
    store.add_prompt(0, [1, 2, 3, 4, 5])
    store.release_outside_window([0], 1)  # blocks 0 and 1 (positions 0..3) go back
    assert store.table(0) == [None, None, 2]
    assert store.cache_blocks(0, [1, 2, 3, 4, 5]) == 0
    assert manager.num_cached_blocks == 0


def test_an_int_subclass_count_is_the_int_it_equals() -> None:
    """As the spec's ``check_int`` takes it: an int subclass of 0 grows by nothing."""

    store = BlockTableStore(BlockManager(8, 2), 2, 4)
    store.add(0, 3)
    store.grow([0], IntSubclass(0))
    store.grow([0], IntSubclass(1))
    assert store.token_count(0) == 4 and store.table(0) == [0, 1]


@pytest.mark.parametrize("step", [1, 2])
def test_a_batch_grow_at_block_boundaries_is_the_spec_per_sequence(step: int) -> None:
    """Two sequences at a block boundary and one inside a block grow by ``step`` tokens (the
    decode fast path when ``step`` is 1): the spec's tables, one ``append_slot`` each."""
    store = BlockTableStore(BlockManager(12, 2), 3, 6)
    spec = spec_bm.BlockManager(12, 2)
    tables = {}
    for seq_id, prompt_len in ((0, 2), (1, 3), (2, 4)):
        store.add(seq_id, prompt_len)
        tables[seq_id] = (spec.allocate(-(-prompt_len // 2)), prompt_len)
    store.grow([0, 1, 2], step)
    for seq_id, (table, count) in tables.items():
        assert store.table(seq_id) == spec.append_slot(table, count + step, step)
        assert store.token_count(seq_id) == count + step
    assert store.manager.free_block_ids() == spec.free_block_ids()


def store_and_spec(
    total_blocks: int, max_seqs: int, max_blocks: int
) -> tuple[PrefixCachingBlockManager, BlockTableStore, spec_pc.PrefixCachingBlockManager]:
    """A prefix-caching store over a pool of ``total_blocks`` blocks of 2 tokens, its manager,
    and the spec's prefix cache of the same pool, for examples that run the same calls on
    both."""
    manager = PrefixCachingBlockManager(total_blocks, 2)
    store = BlockTableStore(manager, max_seqs, max_blocks)
    return manager, store, spec_pc.PrefixCachingBlockManager(total_blocks, 2)


def admit_on_both(
    store: BlockTableStore,
    spec: spec_pc.PrefixCachingBlockManager,
    seq_id: int,
    tokens: list[int],
    extra_key: str | None = None,
) -> list[int | None]:
    """``add_prompt`` on the store and ``allocate_prompt`` on the spec; the spec's table."""
    store.add_prompt(seq_id, tokens, extra_key)
    return spec.allocate_prompt(tokens, extra_key)[0]


def cache_on_both(
    store: BlockTableStore,
    spec: spec_pc.PrefixCachingBlockManager,
    seq_id: int,
    table: list[int | None],
    tokens: list[int],
    extra_key: str | None = None,
) -> int:
    """``cache_blocks`` on the store's sequence and on the spec's table; both must register
    the same number of blocks, which is returned."""
    newly_cached = store.cache_blocks(seq_id, tokens, extra_key)
    assert newly_cached == spec.cache_blocks(table, tokens, extra_key)
    return newly_cached


def test_a_write_into_a_cached_block_a_truncate_left_alone_removes_its_key() -> None:
    """A truncate cuts into a cached block another table holds (the row is flagged tail-shared);
    once the other holder is gone, the next write lands in that block in place, so its key must
    go first, as the spec's ``append_slot`` removes it: a later prompt with the old content hits
    only the untouched block. The spec runs the same calls."""
    prompt = [1, 2, 3, 4]
    manager, store, spec = store_and_spec(8, 2, 4)
    spec_table = admit_on_both(store, spec, 0, prompt)
    cache_on_both(store, spec, 0, spec_table, prompt)
    assert store.add_prompt(1, [*prompt, 5]) == 4  # both blocks hit: shared with sequence 0
    other, _ = spec.allocate_prompt([*prompt, 5])
    store.truncate([0], 3)  # into the shared, cached second block
    spec_table = spec.truncate(spec_table, 3)
    store.remove([1])
    spec.free(other)
    store.grow([0])  # position 3 of the now unshared second block, written in place
    spec_table = spec.append_slot(spec_table, 4)
    assert store.table(0) == spec_table
    assert store.pop_copy_pairs().tolist() == []
    longer = [*prompt, 5]  # a prompt that may hit both blocks
    assert manager.lookup(longer) == spec.lookup(longer) == spec_table[:1]


def test_add_and_admit_check_their_counts() -> None:
    """A bad ``prompt_len`` or ``headroom`` is a typed error naming it, changing nothing; and
    an ``admit`` without a headroom may take the last free blocks."""
    for manager in (BlockManager(2, 2), PrefixCachingBlockManager(2, 2)):
        store = BlockTableStore(manager, 2, 4)
        for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="prompt_len"):
                store.add(0, bad)  # type: ignore[arg-type]
            with pytest.raises(error, match="headroom"):
                store.admit(0, [1, 2], bad)  # type: ignore[arg-type]
        assert len(store) == 0 and manager.num_free_blocks == 2
        assert store.admit(0, [1, 2, 3, 4]) == 0
        assert store.table(0) == [0, 1] and manager.num_free_blocks == 0


def test_cache_blocks_under_another_extra_key_starts_over_as_the_spec() -> None:
    """The store keys a sequence's blocks incrementally, for one extra key. A call with
    another extra key (a cache salt) names other keys for blocks already cached: the spec's
    ``BlockTableError``, changing nothing."""
    prompt = [1, 2, 3, 4, 5]
    manager, store, spec = store_and_spec(8, 2, 4)
    table = admit_on_both(store, spec, 0, prompt, "a")
    store.grow([0])
    table = spec.append_slot(table, 6)
    assert cache_on_both(store, spec, 0, table, prompt, "a") == 2
    for manager_under_test, call in (
        (spec, lambda: spec.cache_blocks(table, [*prompt, 6], "b")),
        (manager, lambda: store.cache_blocks(0, [*prompt, 6], "b")),
    ):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()
        assert manager_under_test.num_cached_blocks == 2


def test_a_block_left_uncached_is_registered_once_its_other_copy_is_evicted() -> None:
    """Two prompts computed at once share a first block's content: the second's copy stays
    uncached. Once the first copy is evicted, the second sequence's next registration caches
    its copy, as the spec's walk over every block does; the prefix hits again."""
    manager = PrefixCachingBlockManager(4, 2)
    store = BlockTableStore(manager, 2, 4)
    store.add_prompt(0, [1, 2, 3])
    store.add_prompt(1, [1, 2, 4])  # no hit yet: computed concurrently
    assert store.cache_blocks(0, [1, 2, 3]) == 1
    assert store.cache_blocks(1, [1, 2, 4]) == 0  # its block 0 duplicates sequence 0's
    kept = store.table(1)[0]
    store.remove([0])  # sequence 0's blocks join the queue, block 0 still cached
    store.add(2, 4)  # takes both: block 0's key is evicted
    assert manager.key_of(kept) is None and manager.num_cached_blocks == 0
    store.grow([1])
    assert store.cache_blocks(1, [1, 2, 4, 5]) == 2  # block 0 retried, block 1 new
    assert manager.lookup([1, 2, 4, 5, 6]) == store.table(1)


def test_a_rollback_then_the_same_tokens_on_reused_blocks_caches_them_again() -> None:
    """A truncate cuts the sequence's own block keys to its kept full blocks. Here the dropped
    blocks are the only free ones, so the regrowth takes them back and evicts their keys; a
    registration of the same tokens must then cache them again, as the spec's does."""
    tokens = [1, 2, 3, 4, 5, 6]
    manager, store, spec = store_and_spec(3, 1, 3)
    table = admit_on_both(store, spec, 0, tokens)
    assert cache_on_both(store, spec, 0, table, tokens) == 3
    store.truncate([0], 2)
    table = spec.truncate(table, 2)
    store.grow([0], 4)
    table = spec.append_slot(table, 6, 4)
    assert store.table(0) == table
    assert cache_on_both(store, spec, 0, table, tokens) == 2
    assert manager.num_cached_blocks == spec.num_cached_blocks == 3


def test_batch_and_slot_mapping_arguments_are_checked() -> None:
    """A batch is made of a 1-D integer array or a list; its rows, the live batch's and the
    store's array views are read-only; ``slot_mapping`` checks ``pad_to`` and refuses a
    sequence with no token."""
    store = BlockTableStore(BlockManager(8, 2), 3, 4)
    store.add(0, 3)
    store.add(1, 0)
    for bad in (np.array([[0]]), np.array([0.0]), np.array([True])):
        with pytest.raises(TypeError, match="seq_ids"):
            store.batch(bad)
    for batch in (store.batch(np.array([0])), store.resolve(None)):
        with pytest.raises(ValueError, match="read-only"):
            batch.rows[0] = 2
    for view in (store.tables, store.num_blocks, store.num_released, store.token_counts):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    for bad, error in ((-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="pad_to must be"):
            store.slot_mapping([0], 1, pad_to=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens exceeds"):
        store.slot_mapping([1])  # the default: each sequence's last position
    assert store.slot_mapping([0]).tolist() == [2]


def test_default_growth_is_one_token_and_not_atomic() -> None:
    """``grow`` and ``grow_or_preempt`` add one token by default, and a default ``grow`` still
    grows the sequences that fit when another cannot."""
    store = BlockTableStore(BlockManager(3, 2), 3, 4)
    store.add(0, 2)
    store.add(1, 2)
    assert store.grow([0, 1]) == [1]  # one free block: sequence 0 takes it
    assert [store.token_count(s) for s in (0, 1)] == [3, 2]
    assert store.grow_or_preempt([0]) == []
    assert store.token_count(0) == 4


def test_token_counts_are_checked_as_an_int_or_one_per_sequence() -> None:
    """``grow``, ``truncate`` and ``slot_mapping`` take one count for all or one per sequence:
    a count array must be 1-D integers, a list one entry per sequence, and no count beyond
    int32 (``CapacityError``, even where a smaller count would be another error)."""
    store = BlockTableStore(BlockManager(8, 2), 2, 4)
    store.add(0, 3)
    store.add(1, 1)
    for bad in (np.array([[1, 1]]), np.array([1.0, 1.0])):
        with pytest.raises(TypeError, match="new_tokens must be an int or a 1-D integer array"):
            store.grow([0, 1], bad)
    with pytest.raises(ValueError, match="token_counts has 1 entries for 2 sequences"):
        store.truncate([0, 1], [1])
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0], 2**31)
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0], [2**31])
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0, 1], [1, 2**31])  # the largest count decides
    with pytest.raises(ValueError, match="do not fit pad_to=1"):
        store.slot_mapping([0, 1], 1, pad_to=1)
    assert [store.token_count(s) for s in (0, 1)] == [3, 1]


def test_counts_of_int32s_largest_are_taken() -> None:
    """Int32's largest count, given as an int subclass or in a list, is a count like any other
    (a block of that size holds it)."""
    for count in (IntSubclass(2**31 - 1), [2**31 - 1]):
        store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
        store.add(0, 0)
        assert store.grow([0], count) == []  # type: ignore[arg-type]
        assert store.token_count(0) == 2**31 - 1


def test_the_live_batch_maps_the_slots_its_ids_map() -> None:
    """``None`` (every live sequence) resolves to the same rows and offsets as its ids."""
    store = BlockTableStore(BlockManager(16, 2), 3, 4)
    for seq_id, count in ((4, 5), (2, 3), (9, 7)):
        store.add(seq_id, count)
    assert store.slot_mapping(None, 2).tolist() == store.slot_mapping([4, 2, 9], 2).tolist()


def test_a_prompt_registered_with_other_tokens_than_planned_is_keyed_by_them() -> None:
    """``cache_blocks`` is told what the K/V holds; when that differs from the admitted
    prompt in a full block, the blocks are keyed by what it is told, as the spec keys them."""
    prompt, written = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    manager, store, spec = store_and_spec(8, 1, 4)
    table = admit_on_both(store, spec, 0, prompt)
    assert cache_on_both(store, spec, 0, table, written) == 2
    for tokens in ([*prompt, 0], [*written, 0]):
        assert manager.lookup(tokens) == spec.lookup(tokens)


def test_a_general_path_growth_keeps_the_keys_of_blocks_it_does_not_write() -> None:
    """A truncate into a shared cached block sends the batch's next growth down grow's general
    path, which removes a key only from a cached block written in place (here sequence 0's,
    once its other holder is gone). Another sequence of the batch whose full, cached last
    block stays as it is (it grows into a fresh block) keeps that block's key, as the spec
    does."""
    manager, store, spec = store_and_spec(10, 3, 4)
    tables = {}
    for seq_id, prompt in ((0, [1, 2, 3, 4]), (1, [1, 2, 3, 4, 5]), (2, [7, 8, 9, 10])):
        tables[seq_id] = admit_on_both(store, spec, seq_id, prompt)
        cache_on_both(store, spec, seq_id, tables[seq_id], prompt)
    store.truncate([0], 3)  # into block 1, which sequence 1 shares
    tables[0] = spec.truncate(tables[0], 3)
    store.remove([1])  # block 1 is sequence 0's alone now: its next write is in place
    spec.free(tables.pop(1))
    store.grow([0, 2])
    tables[0] = spec.append_slot(tables[0], 4)
    tables[2] = spec.append_slot(tables[2], 5)
    for seq_id, table in tables.items():
        assert store.table(seq_id) == table
    for tokens in ([1, 2, 3, 4, 0], [7, 8, 9, 10, 0]):
        assert manager.lookup(tokens) == spec.lookup(tokens)
    assert manager.lookup([7, 8, 9, 10, 0]) == tables[2][:2]


@pytest.mark.parametrize("another_fails", [False, True])
def test_a_zero_token_growth_leaves_a_shared_tail_to_be_copied(another_fails: bool) -> None:
    """A sequence given 0 new tokens in a batch grow writes nothing, so its partly filled last
    block, still shared by a fork, must be copied at its next write, as the spec copies it;
    whether the batch grew at once or, with ``another_fails``, in order with a sequence that
    could not grow."""
    store = BlockTableStore(BlockManager(4, 2), 4, 4)
    spec = spec_bm.BlockManager(4, 2)
    store.add(0, 3)
    table = spec.allocate(2)
    store.fork(0, 1)
    store.fork(0, 2)
    forks = [spec.fork(table), spec.fork(table)]
    store.add(3, 2)
    other = spec.allocate(1)
    ids, counts = ([0, 1, 3], [0, 1, 4]) if another_fails else ([0, 1], [0, 1])
    # Sequence 1 copies the shared block (the last free one); 0 and 2 still share it.
    assert store.grow(ids, counts) == ([3] if another_fails else [])
    forks[0] = spec.append_slot(forks[0], 4)
    store.remove([3])
    spec.free(other)
    store.grow([0])
    table = spec.append_slot(table, 4)
    assert [store.table(s) for s in (0, 1, 2)] == [table, *forks]
    assert store.pop_copy_pairs().tolist() == [list(pair) for pair in spec.pop_copy_pairs()]


def test_a_removed_sequences_keys_do_not_outlive_it() -> None:
    """A new sequence that reuses a removed one's id starts with no block keys: when it holds
    the same tokens in blocks whose old keys were evicted, registering caches them again."""
    tokens = [1, 2, 3, 4]
    manager = PrefixCachingBlockManager(2, 2)
    store = BlockTableStore(manager, 1, 2)
    store.add_prompt(0, tokens)
    assert store.cache_blocks(0, tokens) == 2
    store.remove([0])
    store.add(0, 4)  # takes both blocks back: their keys are evicted
    assert manager.num_cached_blocks == 0
    assert store.cache_blocks(0, tokens) == 2


def test_after_a_rollback_other_tokens_in_a_kept_block_are_refused_as_the_spec() -> None:
    """A truncate keeps the sequence's keys of its kept full blocks, with their tokens. A
    registration that then names other tokens for a kept cached block is refused with the
    spec's ``BlockTableError``, however few of the kept tokens differ."""
    tokens = [1, 2, 3, 4, 5, 6]
    _, store, spec = store_and_spec(4, 1, 3)
    table = admit_on_both(store, spec, 0, tokens)
    cache_on_both(store, spec, 0, table, tokens)
    store.truncate([0], 4)
    table = spec.truncate(table, 4)
    other = [1, 2, 9, 4]  # block 1 named with another token
    for call in (lambda: spec.cache_blocks(table, other), lambda: store.cache_blocks(0, other)):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()


def test_a_rollback_forgets_the_retries_of_the_blocks_it_drops() -> None:
    """Blocks left uncached (their content cached in another sequence's blocks) are retried
    at the next registration; a truncate drops the retries of the blocks it drops, so the
    next registration of the kept tokens retries only kept blocks, as the spec's walk does."""
    tokens = [1, 2, 3, 4, 5, 6]
    _, store, spec = store_and_spec(8, 2, 3)
    tables = []
    for seq_id in (0, 1):  # computed concurrently: no hit
        tables.append(admit_on_both(store, spec, seq_id, tokens))
    for seq_id, table in enumerate(tables):
        cache_on_both(store, spec, seq_id, table, tokens)
    store.truncate([1], 4)
    tables[1] = spec.truncate(tables[1], 4)
    assert cache_on_both(store, spec, 1, tables[1], tokens[:4]) == 0


def test_preemption_over_shared_prefix_blocks_stops_once_the_rest_can_grow() -> None:
    """Victims that share prefix-cache blocks free only the blocks they held last. Here the
    tail sequence's removal lets the first grow, and the one between needs no new block: it
    grows too, and only the tail is preempted."""
    system = [1, 2, 3, 4]
    manager = PrefixCachingBlockManager(5, 2)
    store = BlockTableStore(manager, 4, 4)
    store.add_prompt(9, [*system, 0])
    store.cache_blocks(9, [*system, 0])
    store.remove([9])  # the system prompt's two blocks stay cached
    for seq_id, tail in ((0, [5, 6]), (1, [7]), (2, [8, 9])):
        assert store.add_prompt(seq_id, [*system, *tail]) == 4
    assert manager.num_free_blocks == 0
    assert store.grow_or_preempt([0, 1, 2]) == [2]
    assert [store.token_count(s) for s in (0, 1)] == [7, 6]
