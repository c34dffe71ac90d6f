"""The store machines: ``BlockTableStore`` against the spec called per sequence in batch order
(a released entry: spec ``None``, store ``-1``); slots, exports and errors match, and after every
step the table array, queue and reference counts agree. ``STORE``/``PAGE_TABLES`` are swappable."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks import PAD, BlockTableStore, CapacityError, SeqBatch, page_tables
from pagedkv.impl.blocks.manager import BlockManager
from properties.machines.lockstep import Lockstep

MAX_SEQ_ID = 11
SEQ_IDS = st.integers(0, MAX_SEQ_ID)


def padded_table(table: list[int | None]) -> list[int]:
    """A spec table as the store's arrays hold it: a released entry (None) is ``PAD``."""
    return [PAD if block is None else block for block in table]


class StoreMachine(Lockstep, RuleBasedStateMachine):
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
        # seq id -> (table, token count); released entries are None, as in the spec
        self.seqs: dict[int, tuple[list[int | None], int]] = {}
        self.batches: list[SeqBatch] = []

    def snapshot(self) -> tuple[Any, ...]:
        store = self.store
        return (
            store.tables.tobytes(), store.num_blocks.tobytes(), store.token_counts.tobytes(),
            store.seq_ids, store.manager.free_block_ids(), store.manager.ref_counts().tobytes(),
        )  # fmt: skip

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

    def fork_both(self, parent: int, child: int) -> int:
        self.store.fork(parent, child)
        table, count = self.seqs[parent]
        self.seqs[child] = (self.spec.fork(table), count)
        return count

    def fork_new(self, data: st.DataObject) -> tuple[int, int, int]:
        """A drawn parent forked into the smallest free id: ``(parent, child, token count)``."""
        child = min(set(range(len(self.seqs) + 1)) - set(self.seqs))
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        return parent, child, self.fork_both(parent, child)

    @rule(seq_id=SEQ_IDS, data=st.data())
    def add(self, seq_id: int, data: st.DataObject) -> None:
        prompt_len = data.draw(st.integers(0, (self.max_blocks + 1) * self.block_size))
        needed = spec_bm.blocks_needed(prompt_len, self.block_size)
        if seq_id in self.seqs:
            self.refuses(ValueError, self.store.add, seq_id, prompt_len)
        elif needed > self.max_blocks or len(self.seqs) == self.max_seqs:
            self.refuses(CapacityError, self.store.add, seq_id, prompt_len)
        elif needed > self.spec.num_free_blocks:
            self.refuses(spec_bm.OutOfBlocksError, self.store.add, seq_id, prompt_len)
        else:
            self.store.add(seq_id, prompt_len)
            self.seqs[seq_id] = (self.spec.allocate(needed), prompt_len)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), child=SEQ_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        if child in self.seqs:
            self.refuses(ValueError, self.store.fork, parent, child)
        elif len(self.seqs) == self.max_seqs:
            self.refuses(CapacityError, self.store.fork, parent, child)
        else:
            self.fork_both(parent, child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        ids = self.some_live(data)
        self.store.remove(self.as_batch(data, ids))
        for seq_id in ids:
            self.spec.free(self.seqs.pop(seq_id)[0])

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
            self.check_grow(data, ids, steps, np.array(steps, np.int32) if as_array else steps)
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
        parent, child, _ = self.fork_new(data)
        ids = data.draw(st.permutations(sorted(self.seqs)))
        ids = [s for s in ids if s in (parent, child) or data.draw(st.booleans())]
        self.check_grow(data, ids, [1] * len(ids), 1)

    def check_grow(
        self, data: st.DataObject, ids: list[int], steps: list[int], argument: Any
    ) -> None:
        """``grow`` is per-sequence ``append_slot``; a failed ``atomic`` grow changes nothing."""
        batch = self.as_batch(data, ids)
        fits = all(
            spec_bm.blocks_needed(self.seqs[s][1] + k, self.block_size) <= self.max_blocks
            for s, k in zip(ids, steps, strict=True)
        )
        if not fits:
            self.refuses(CapacityError, self.store.grow, batch, argument)
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
                self.refuses(spec_bm.BlockTableError, self.store.grow, batch, argument)
                return
        atomic = data.draw(st.booleans(), label="atomic")
        assert self.store.grow(batch, argument, atomic=atomic) == failed
        if atomic and failed:
            return  # nothing changed: the invariants compare the store with the untouched spec
        self.spec, self.seqs = trial, seqs
        expected, actual = self.spec.pop_copy_pairs(), self.store.pop_copy_pairs()
        assert actual.dtype == np.int32 and actual.shape == (len(expected), 2)
        assert [tuple(pair) for pair in actual.tolist()] == expected
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
            self.refuses(error, self.store.truncate, self.as_batch(data, ids), bad)
            counts[index] = bad
            self.refuses(error, self.store.truncate, self.as_batch(data, ids), counts)
            return
        self.check_truncate(data, ids, counts)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """A speculative step: write the last token and ``k`` drafts, keep ``1 + j`` of them."""
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
        """Fork, cut one into a shared block, decode: the write into it must copy it."""
        parent, child, count = self.fork_new(data)
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

    def spec_slots(self, ids: list[int], counts: list[int]) -> list[int]:
        """The spec's slots of each sequence's last ``k`` tokens, in batch order."""
        return [
            self.spec.translate_slot(self.seqs[s][0], position)
            for s, k in zip(ids, counts, strict=True)
            for position in range(self.seqs[s][1] - k, self.seqs[s][1])
        ]

    def check_slot_mapping(self, data: st.DataObject, grown: list[tuple[int, int]]) -> None:
        """The step's new tokens map to the spec's slots, -1 padded."""
        ids, counts = [s for s, _ in grown], [k for _, k in grown]
        expected = self.spec_slots(ids, counts)
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
            expected = self.spec_slots(ids, counts)
        except spec_bm.BlockTableError:  # a position in a released entry
            event("slot_mapping: a released position refused")
            batch = self.as_batch(data, ids)
            self.refuses(spec_bm.BlockTableError, self.store.slot_mapping, batch, counts)
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

    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        """Unknown, repeated or non-int ids, bad counts: the documented error, nothing changes."""
        live = sorted(self.seqs)
        unknown = [s for s in range(12) if s not in self.seqs]
        store, layouts = self.store, self.PAGE_TABLES
        calls: dict[str, Callable[..., object]] = {  # in the order the search was tuned on
            "grow": store.grow, "remove": store.remove, "slot_mapping": store.slot_mapping,
            "block_tables": lambda seqs: layouts.block_tables(store, seqs),
            "flashinfer": lambda seqs: layouts.flashinfer_page_table(store, seqs),
            "batch": store.batch,
            "truncate": lambda seqs, token_counts=0: store.truncate(seqs, token_counts),
            "release": lambda seqs: store.release_outside_window(seqs, 1),
        }  # fmt: skip
        name = data.draw(st.sampled_from(list(calls)))
        call = calls[name]
        case = data.draw(
            st.sampled_from(["unknown", "repeated", "type", "count", "too many", "seq id"])
        )
        if case == "unknown" and unknown:
            ids = data.draw(st.permutations([*live, data.draw(st.sampled_from(unknown))]))
            self.refuses(KeyError, call, ids)
        elif case == "repeated" and live:
            twice = data.draw(st.sampled_from(live))
            ids = data.draw(st.permutations([*live, twice]))
            message = self.refuses(ValueError, call, ids)
            assert message.endswith(f"repeated within one batch: [{twice}]"), message
        elif case == "type":
            bad = data.draw(st.sampled_from([True, 1.0, "1", None, np.int64(1)]))
            self.refuses(TypeError, call, data.draw(st.permutations([*live, bad])))
            self.refuses(TypeError, call, {1, 2})
            self.refuses(TypeError, call, np.array([1.0]))
        elif case == "count" and live and name in ("grow", "slot_mapping", "truncate"):
            value = data.draw(st.sampled_from([-1, 1.5, True, None]))
            error = ValueError if value == -1 else TypeError
            per_seq = data.draw(st.booleans())
            argument = [1] * (len(live) - 1) + [value] if per_seq else value
            self.refuses(error, call, live, argument)
            self.refuses(ValueError, call, live, [1] * (len(live) + 1))  # wrong length
        elif case == "too many" and live:
            seq_id = data.draw(st.sampled_from(live))
            count = self.seqs[seq_id][1]
            self.refuses(ValueError, store.slot_mapping, [seq_id], count + 1)
            if count:
                self.refuses(ValueError, store.slot_mapping, [seq_id], count, count - 1)
        elif case == "seq id":
            seq_id = data.draw(st.sampled_from([True, 1.0, None, "3"]))
            self.refuses(TypeError, store.add, seq_id, 1)
            if live:
                self.refuses(TypeError, store.fork, live[0], seq_id)
            self.refuses(KeyError, store.remove, [-(2**70)])

    @invariant()
    def same_state(self) -> None:
        """Tables, padding, free rows, queue, reference counts and (copied) pending pairs agree."""
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
        pending = store.pending_copy_pairs()
        assert [tuple(pair) for pair in pending.tolist()] == self.spec.pending_copy_pairs()
        assert store.manager.waiting_for_copy == self.spec.waiting_for_copy


class WindowStoreMachine(StoreMachine):
    """``StoreMachine`` plus window releases (a subclass, so the base searches are unchanged)."""

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release_outside_window(self, data: st.DataObject) -> None:
        """Release what no later query reads, at token counts or drawn positions; or refused."""
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
            count = self.seqs[ids[0]][1]
            error, args = {
                "window 0": (ValueError, (0,)), "window 1.0": (TypeError, (1.0,)),
                "count -1": (ValueError, (1, -1)), "1.0": (TypeError, (1, [1.0] * len(ids))),
                "over": (ValueError, (1, [count] * (len(ids) - 1) + [capacity[ids[-1]] + 1])),
            }[bad]  # fmt: skip
            self.refuses(error, self.store.release_outside_window, self.as_batch(data, ids), *args)
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
        """A window-1 release at capacity frees a partly filled last block; writing there fails."""
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
