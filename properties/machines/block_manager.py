"""Any class with the spec's API in lockstep with ``BlockModel``, simulating KV data: each token
stores a unique value at its slot, copy pairs copy blocks, and every live sequence reads back
exactly its own tokens ("no two sequences ever write the same slot")."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from pagedkv.spec import BlockTableError
from properties.block_model import BlockModel, observe
from properties.machines.lockstep import Lockstep

BLOCK_SIZES = [1, 2, 3, 4, 8, 16]
BAD_COUNTS = st.one_of(
    st.tuples(st.integers(-3, -1), st.integers(-3, 50)),
    st.tuples(st.integers(0, 50), st.integers(-3, -1)),
    st.integers(0, 49).flatmap(lambda count: st.tuples(st.just(count), st.integers(count + 1, 50))),
)
"""``(token_count, new_tokens)`` that ``append_slot`` refuses: negative, or more new than tokens."""


@dataclass(eq=False)
class Sequence:
    table: list[int | None]  # None: a block a sliding window released
    tokens: list[int] = field(default_factory=list)  # the value stored for each position

    def readable(self, size: int) -> range:
        """The positions whose blocks the table still holds."""
        released = 0
        while released < len(self.table) and self.table[released] is None:
            released += 1
        return range(min(released * size, len(self.tokens)), len(self.tokens))


def block_manager_machine(manager_cls: type) -> type[RuleBasedStateMachine]:

    class BlockManagerMachine(Lockstep, RuleBasedStateMachine):
        seqs = Bundle("seqs")  # live sequences
        freed = Bundle("freed")  # sequences already freed: their tables are stale

        def __init__(self) -> None:
            super().__init__()
            self.live: list[Sequence] = []
            self.cache: dict[int, int] = {}  # physical slot -> stored token value
            self.pending_pairs: list[tuple[int, int]] = []  # copy pairs not yet taken
            self.values = itertools.count(1)

        @initialize(total_blocks=st.integers(1, 32), block_size=st.sampled_from(BLOCK_SIZES))
        def make_manager(self, total_blocks: int, block_size: int) -> None:
            self.impl = manager_cls(total_blocks, block_size)
            self.model = BlockModel(total_blocks, block_size)
            self.size = block_size

        def snapshot(self) -> tuple[object, ...]:
            refs = tuple(self.impl.ref_count(b) for b in range(self.model.total_blocks))
            pending = self.impl.pending_copy_pairs()
            waiting = list(self.impl.waiting_for_copy)
            return (self.impl.free_block_ids(), refs, self.impl.num_free_blocks, pending,
                    waiting)  # fmt: skip

        def expect(self, name: str, *args: object) -> tuple[str, object]:
            expected = getattr(self.model, name)(*args)
            return ("raised", expected.error) if expected.error else ("ok", expected.value)

        def after(self, name: str, args: tuple, expected: tuple[str, object]) -> None:
            event(f"outcome: {expected[1].__name__ if expected[0] == 'raised' else 'ok'}")

        def write(self, seq: Sequence, first: int, values: list[int]) -> None:
            for offset, value in enumerate(values):
                pos = first + offset
                self.cache[seq.table[pos // self.size] * self.size + pos % self.size] = value

        def copy_block(self, src: int, dst: int) -> None:
            for offset in range(self.size):
                slot = src * self.size + offset
                if slot in self.cache:
                    self.cache[dst * self.size + offset] = self.cache[slot]

        @rule(target=seqs, prompt_len=st.integers(0, 40))
        def new_sequence(self, prompt_len: int) -> object:
            kind, table = self.both("allocate", -(-prompt_len // self.size))
            if kind == "ok":
                seq = Sequence(table)
                seq.tokens = [next(self.values) for _ in range(prompt_len)]
                self.write(seq, 0, seq.tokens)
                self.live.append(seq)
                return seq
            return multiple()

        @rule(
            seq=seqs,
            new_tokens=st.one_of(st.just(1), st.integers(0, 40)),
            lookahead=st.one_of(st.just(0), st.integers(0, 20)),
        )
        def append(self, seq: Sequence, new_tokens: int, lookahead: int) -> None:
            """Write ``new_tokens`` tokens; ``lookahead`` extra slots are reserved, not written."""
            self.write_tokens(seq, new_tokens, lookahead)

        def write_tokens(self, seq: Sequence, new_tokens: int, lookahead: int) -> bool:
            """Reserve ``lookahead`` slots unwritten, then write; whether the tokens were."""
            count = len(seq.tokens)
            for target, written in ((count + lookahead, 0), (count + new_tokens, new_tokens)):
                kind, table = self.both("append_slot", seq.table, target, written)
                if kind == "raised":
                    return False
                made = self.model.copy_pairs[len(self.pending_pairs) :]
                if made:
                    event("copy-on-write")
                for src, dst in made:  # the caller copies before writing
                    self.copy_block(src, dst)
                self.pending_pairs += made
                seq.table = table
            for pos in range(count, count + new_tokens):
                block = seq.table[pos // self.size]
                assert self.impl.ref_count(block) == 1, f"write into shared block {block}"
            values = [next(self.values) for _ in range(new_tokens)]
            self.write(seq, count, values)
            seq.tokens += values
            return True

        @rule(seq=seqs, data=st.data())
        def truncate(self, seq: Sequence, data: st.DataObject) -> None:
            """Roll back to any count the table can hold; past its capacity is refused."""
            capacity = len(seq.table) * self.size
            count = data.draw(
                st.integers(0, capacity)
                | st.integers(-2, capacity + self.size)
                | st.integers(capacity + 1, capacity + self.size),  # past the capacity: refused
                label="count",
            )
            self.roll_back(seq, count)

        @rule(seq=seqs, drafts=st.integers(0, 6), data=st.data())
        def speculate(self, seq: Sequence, drafts: int, data: st.DataObject) -> None:
            """A speculative step: write the last token and ``drafts`` guesses, keep ``1 + j``."""
            count = len(seq.tokens)
            if self.write_tokens(seq, 1 + drafts, 0):
                self.roll_back(seq, count + 1 + data.draw(st.integers(0, drafts), label="j"))

        def roll_back(self, seq: Sequence, count: int) -> None:
            kind, table = self.both("truncate", seq.table, count)
            if kind == "ok":
                event("truncate: dropped blocks" if table != seq.table else "truncate")
                seq.table = table
                del seq.tokens[count:]

        @rule(seq=seqs, window=st.integers(1, 20), data=st.data())
        def slide(self, seq: Sequence, window: int, data: st.DataObject) -> None:
            """Release what no later query reads, at the count or any other (maybe refused)."""
            capacity = len(seq.table) * self.size
            count = data.draw(
                st.just(len(seq.tokens))
                | st.integers(-1, capacity + 1)
                | st.integers(capacity + 1, capacity + self.size),  # past the capacity: refused
                label="count",
            )
            self.release_at(seq, count, window)

        @rule(seq=seqs, window=st.integers(1, 8), back=st.integers(1, 8))
        def rewrite_behind_the_window(self, seq: Sequence, window: int, back: int) -> None:
            """Release, roll ``back`` tokens back, rewrite: writing a released block is refused."""
            self.release_at(seq, len(seq.tokens), window)
            self.roll_back(seq, max(0, len(seq.tokens) - back))
            self.write_tokens(seq, back, 0)

        def release_at(self, seq: Sequence, count: int, window: int) -> None:
            kind, table = self.both("release_outside_window", seq.table, count, window)
            if kind == "ok":
                released = table.count(None) > seq.table.count(None)
                event("window: released blocks" if released else "window: nothing to release")
                seq.table = table
                held = sum(b is not None for b in seq.table)
                if len(seq.table) == -(-count // self.size):  # memory bounded by the window
                    assert held <= -(-(window - 1) // self.size) + 1, (held, window)

        @rule()
        def take_copy_pairs(self) -> None:
            """Pairs stay pending, failed calls included, until the caller takes them, once."""
            if self.model.parked:
                event("a copy source waited for its copy")
            assert self.impl.pop_copy_pairs() == self.pending_pairs
            assert self.impl.pop_copy_pairs() == []
            self.model.pop_copy_pairs()
            self.pending_pairs = []

        @rule(target=seqs, parent=seqs)
        def fork(self, parent: Sequence) -> Sequence:
            child = Sequence(self.both("fork", parent.table)[1], list(parent.tokens))
            self.live.append(child)
            return child

        @rule(target=seqs, parent=consumes(seqs), new_tokens=st.integers(1, 8))
        def replace_by_a_fork(self, parent: Sequence, new_tokens: int) -> Sequence:
            """A beam step: fork, write the child (copy-on-write), free the parent: a pending
            copy's source may lose its last table before the pairs are taken."""
            child = self.fork(parent)
            self.write_tokens(child, new_tokens, 0)
            self.free(parent)
            return child

        @rule(target=freed, seq=consumes(seqs))
        def free(self, seq: Sequence) -> Sequence:
            self.both("free", seq.table)
            self.live.remove(seq)
            return seq

        @rule(seq=seqs, pos=st.integers(-2, 60))
        def translate(self, seq: Sequence, pos: int) -> None:
            self.both("translate_slot", seq.table, pos)

        @rule(seq=freed, pos=st.integers(0, 3))
        def double_free(self, seq: Sequence, pos: int) -> None:
            """A stale table's free and read are refused (only read if its blocks were reissued)."""
            self.both("translate_slot", seq.table, pos)
            if self.model.table_error(seq.table) is BlockTableError:  # stale, not just released
                self.both("free", seq.table)
                self.both("truncate", seq.table, 0)

        @rule(
            seq=seqs,
            bad=st.sampled_from(["repeated", "negative", "one past the last", "far past"]),
            operation=st.sampled_from(["free", "fork", "append", "translate", "truncate"]),
        )
        def repeated_or_unknown_ids(self, seq: Sequence, bad: str, operation: str) -> None:
            """A live table plus one bad id (a repeat of its first id, or an unknown one)."""
            total = self.model.total_blocks
            bad_ids = {"negative": -1, "one past the last": total, "far past": total + 7}
            table = [*seq.table, seq.table[0] if seq.table else 0]
            if bad != "repeated" or not seq.table:
                table[-1] = bad_ids.get(bad, -1)
            calls = {"append": ("append_slot", 1, 1), "translate": ("translate_slot", 0)}
            name, *extra = {**calls, "truncate": ("truncate", 0)}.get(operation, (operation,))
            self.both(name, table, *extra)

        @rule(offset=st.integers(-2, 1))
        def can_allocate(self, offset: int) -> None:
            """``can_allocate(n)`` is ``n <= num_free_blocks``: at the boundary, and for 0."""
            free = len(self.model.queue)
            for count in (0, max(0, free + offset)):
                assert self.impl.can_allocate(count) == (count <= free), count

        @rule(extra=st.integers(1, 3))
        def allocate_too_many(self, extra: int) -> None:
            """More blocks than are free: refused, and the pending copy pairs stay pending."""
            self.both("allocate", len(self.model.queue) + extra)

        @rule(count=st.integers(-5, -1))
        def negative_allocate(self, count: int) -> None:
            self.both("allocate", count)

        @rule(seq=seqs, counts=BAD_COUNTS)
        def append_bad_counts(self, seq: Sequence, counts: tuple[int, int]) -> None:
            """Negative counts, or more new tokens than tokens, are refused."""
            self.both("append_slot", seq.table, *counts)

        @rule(value=st.sampled_from([1.0, "2", None, True]))
        def wrong_types(self, value: object) -> None:
            before = self.snapshot()
            for call in (self.impl.allocate, self.impl.can_allocate, self.impl.free):
                assert observe(call, value).error is TypeError, call
            if value is not None:  # [None] is a table whose one block was released
                assert observe(self.impl.free, [value]).error is TypeError
            assert observe(self.impl.free, [0, value]).error is TypeError
            assert observe(self.impl.append_slot, [], value).error is TypeError
            assert observe(self.impl.truncate, [], value).error is TypeError
            assert observe(self.impl.truncate, value, 0).error is TypeError
            assert self.snapshot() == before

        @invariant()
        def queue_matches_model(self) -> None:
            assert self.impl.free_block_ids() == self.model.queue
            assert self.impl.num_free_blocks == len(self.impl.free_block_ids())
            held = self.model.total_blocks - len(self.model.queue)
            assert self.impl.usage == held / self.model.total_blocks

        @invariant()
        def pending_pairs_match(self) -> None:
            """Untaken pairs and waiting sources match; no pair writes what an earlier one reads."""
            assert self.impl.pending_copy_pairs() == self.pending_pairs
            assert list(self.impl.waiting_for_copy) == self.model.parked
            read: set[int] = set()
            for src, dst in self.pending_pairs:
                read.add(src)
                assert dst not in read, f"pair {(src, dst)} overwrites a pending source"

        @invariant()
        def ref_counts_equal_live_references(self) -> None:
            held = [b for seq in self.live for b in seq.table if b is not None]
            for block_id in range(self.model.total_blocks):
                ref = self.impl.ref_count(block_id)
                assert ref == self.model.refs[block_id] == held.count(block_id)
                in_queue = block_id in self.impl.free_block_ids()
                waiting = block_id in self.model.parked
                assert in_queue == (ref == 0 and not waiting), f"block {block_id}: not one state"

        @invariant()
        def every_sequence_reads_its_own_tokens(self) -> None:
            for seq in self.live:
                for pos in seq.readable(self.size):
                    value = seq.tokens[pos]
                    slot = seq.table[pos // self.size] * self.size + pos % self.size
                    assert self.cache.get(slot) == value, f"slot {slot} lost position {pos}"

    return BlockManagerMachine
