"""A Hypothesis state machine that drives a block manager and checks it against ``BlockModel``.

``block_manager_machine(manager_cls)`` builds the machine for any class with the spec's API, so the
same rules check ``spec``, planted-bug mutants of it, and anything else that claims its semantics.

Besides the block bookkeeping, the machine simulates the KV data: every written token stores a
unique value at its physical slot, copy-on-write pairs copy whole blocks, and after every step each
live sequence must read back exactly its own tokens through its block table. That is the
user-visible meaning of "no two sequences ever write the same physical slot".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from properties.block_model import BlockModel, Outcome, observe

BLOCK_SIZES = [1, 2, 3, 4, 8, 16]


@dataclass
class Sequence:
    table: list[int]
    tokens: list[int] = field(default_factory=list)  # the value stored for each position


def block_manager_machine(manager_cls: type) -> type[RuleBasedStateMachine]:
    """Return a state machine class checking ``manager_cls`` against the model."""

    class BlockManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.seqs: dict[int, Sequence] = {}
            self.dead_tables: list[list[int]] = []
            self.cache: dict[int, int] = {}  # physical slot -> stored token value
            self.pending_pairs: list[tuple[int, int]] = []  # copy pairs not yet taken
            self.names = itertools.count()
            self.values = itertools.count(1)

        @initialize(total_blocks=st.integers(1, 32), block_size=st.sampled_from(BLOCK_SIZES))
        def make_manager(self, total_blocks: int, block_size: int) -> None:
            self.manager = manager_cls(total_blocks, block_size)
            self.model = BlockModel(total_blocks, block_size)
            self.size = block_size

        # ------------------------------------------------------------ helpers

        def snapshot(self) -> tuple:
            refs = tuple(self.manager.ref_count(b) for b in range(self.model.total_blocks))
            return (self.manager.free_block_ids(), refs, self.manager.num_free_blocks)

        def check_same(self, actual: Outcome, expected: Outcome, before: tuple) -> None:
            """The call did what the model says; if it raised, it changed nothing."""
            event(f"outcome: {expected.error.__name__ if expected.error else 'ok'}")
            assert actual.error == expected.error, (actual, expected)
            assert actual.value == expected.value, (actual, expected)
            if expected.error is not None:
                assert self.snapshot() == before, "a failed call changed the manager"

        def on_table(self, call, table: list[int], *args: int) -> Outcome:
            """Observe ``call(table, *args)``; it must leave its table argument as it was."""
            argument = list(table)
            outcome = observe(call, table, *args)
            assert table == argument, f"{call.__name__} mutated its block_table argument"
            return outcome

        def write(self, seq: Sequence, first: int, values: list[int]) -> None:
            for offset, value in enumerate(values):
                pos = first + offset
                self.cache[seq.table[pos // self.size] * self.size + pos % self.size] = value

        def copy_block(self, src: int, dst: int) -> None:
            for offset in range(self.size):
                slot = src * self.size + offset
                if slot in self.cache:
                    self.cache[dst * self.size + offset] = self.cache[slot]

        def pick(self, data: st.DataObject) -> int:
            return data.draw(st.sampled_from(sorted(self.seqs)), label="sequence")

        # ------------------------------------------------------------ rules

        @rule(prompt_len=st.integers(0, 40))
        def new_sequence(self, prompt_len: int) -> None:
            blocks = -(-prompt_len // self.size)
            before = self.snapshot()
            expected = self.model.allocate(blocks)
            actual = observe(self.manager.allocate, blocks)
            self.check_same(actual, expected, before)
            if expected.error is None:
                seq = Sequence(table=actual.value)
                seq.tokens = [next(self.values) for _ in range(prompt_len)]
                self.write(seq, 0, seq.tokens)
                self.seqs[next(self.names)] = seq

        @precondition(lambda self: self.seqs)
        @rule(
            data=st.data(),
            new_tokens=st.one_of(st.just(1), st.integers(0, 40)),
            lookahead=st.one_of(st.just(0), st.integers(0, 20)),
        )
        def append(self, data: st.DataObject, new_tokens: int, lookahead: int) -> None:
            """Write ``new_tokens`` tokens; ``lookahead`` extra slots are reserved, not written."""
            seq = self.seqs[self.pick(data)]
            count = len(seq.tokens)
            before = self.snapshot()
            # Reserve lookahead slots without writing, then write the new tokens.
            for target, written in ((count + lookahead, 0), (count + new_tokens, new_tokens)):
                expected = self.model.append_slot(seq.table, target, written)
                actual = self.on_table(self.manager.append_slot, seq.table, target, written)
                self.check_same(actual, expected, before)
                if expected.error is not None:
                    return
                before = self.snapshot()
                if self.model.copy_pairs:
                    event("copy-on-write")
                for src, dst in self.model.copy_pairs:  # the caller copies before writing
                    self.copy_block(src, dst)
                self.pending_pairs += self.model.copy_pairs
                self.model.copy_pairs.clear()
                seq.table = actual.value
            for pos in range(count, count + new_tokens):
                block = seq.table[pos // self.size]
                assert self.manager.ref_count(block) == 1, f"write into shared block {block}"
            values = [next(self.values) for _ in range(new_tokens)]
            self.write(seq, count, values)
            seq.tokens += values

        @rule()
        def take_copy_pairs(self) -> None:
            """Pairs stay pending, failed calls included, until the caller takes them, once."""
            assert self.manager.pop_copy_pairs() == self.pending_pairs
            assert self.manager.pop_copy_pairs() == []
            self.pending_pairs = []

        @precondition(lambda self: self.seqs)
        @rule(data=st.data())
        def fork(self, data: st.DataObject) -> None:
            parent = self.seqs[self.pick(data)]
            before = self.snapshot()
            expected = self.model.fork(parent.table)
            actual = self.on_table(self.manager.fork, parent.table)
            self.check_same(actual, expected, before)
            self.seqs[next(self.names)] = Sequence(table=actual.value, tokens=list(parent.tokens))

        @precondition(lambda self: self.seqs)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            seq = self.seqs.pop(self.pick(data))
            before = self.snapshot()
            self.check_same(
                self.on_table(self.manager.free, seq.table),
                self.model.free(seq.table),
                before,
            )
            self.dead_tables.append(seq.table)

        @precondition(lambda self: self.seqs)
        @rule(data=st.data(), pos=st.integers(-2, 60))
        def translate(self, data: st.DataObject, pos: int) -> None:
            seq = self.seqs[self.pick(data)]
            before = self.snapshot()
            expected = self.model.translate_slot(seq.table, pos)
            actual = self.on_table(self.manager.translate_slot, seq.table, pos)
            self.check_same(actual, expected, before)

        # ------------------------------------------------------------ bad input

        @precondition(lambda self: self.dead_tables)
        @rule(data=st.data())
        def double_free(self, data: st.DataObject) -> None:
            """Freeing a table again is refused unless all its blocks were re-allocated."""
            table = data.draw(st.sampled_from(self.dead_tables), label="dead table")
            if all(self.model.refs[b] > 0 for b in table):
                return  # all re-allocated: indistinguishable from a live table, not a bad input
            before = self.snapshot()
            self.check_same(observe(self.manager.free, table), self.model.free(table), before)

        @precondition(lambda self: any(s.table for s in self.seqs.values()))
        @rule(data=st.data(), operation=st.sampled_from(["free", "fork", "append", "translate"]))
        def repeated_or_unknown_ids(self, data: st.DataObject, operation: str) -> None:
            seq = self.seqs[self.pick(data)]
            if not seq.table:
                return
            bad_id = data.draw(
                st.sampled_from(
                    [seq.table[0], -1, self.model.total_blocks, self.model.total_blocks + 7]
                ),
                label="bad id",
            )
            table = [*seq.table, bad_id]
            before = self.snapshot()
            calls = {
                "free": (self.manager.free, self.model.free, ()),
                "fork": (self.manager.fork, self.model.fork, ()),
                "append": (self.manager.append_slot, self.model.append_slot, (1, 1)),
                "translate": (self.manager.translate_slot, self.model.translate_slot, (0,)),
            }
            call, model_call, extra = calls[operation]
            self.check_same(self.on_table(call, table, *extra), model_call(table, *extra), before)

        @rule(count=st.integers(-5, -1))
        def negative_allocate(self, count: int) -> None:
            before = self.snapshot()
            self.check_same(
                observe(self.manager.allocate, count), self.model.allocate(count), before
            )

        @precondition(lambda self: self.seqs)
        @rule(data=st.data(), token_count=st.integers(-3, 50), new_tokens=st.integers(-3, 50))
        def append_bad_counts(self, data: st.DataObject, token_count: int, new_tokens: int) -> None:
            """Negative counts, or more new tokens than tokens, are refused."""
            if token_count >= 0 and 0 <= new_tokens <= token_count:
                return
            seq = self.seqs[self.pick(data)]
            before = self.snapshot()
            self.check_same(
                self.on_table(self.manager.append_slot, seq.table, token_count, new_tokens),
                self.model.append_slot(seq.table, token_count, new_tokens),
                before,
            )

        @rule(value=st.sampled_from([1.0, "2", None, True]))
        def wrong_types(self, value: object) -> None:
            before = self.snapshot()
            for call in (self.manager.allocate, self.manager.can_allocate, self.manager.free):
                assert observe(call, value).error is TypeError, call
            assert observe(self.manager.free, [value]).error is TypeError
            assert observe(self.manager.append_slot, [], value).error is TypeError
            assert self.snapshot() == before

        # ------------------------------------------------------------ invariants

        @invariant()
        def queue_matches_model(self) -> None:
            assert self.manager.free_block_ids() == self.model.queue
            assert self.manager.num_free_blocks == len(self.manager.free_block_ids())

        @invariant()
        def ref_counts_equal_live_references(self) -> None:
            held = [b for seq in self.seqs.values() for b in seq.table]
            for block_id in range(self.model.total_blocks):
                ref = self.manager.ref_count(block_id)
                assert ref == self.model.refs[block_id] == held.count(block_id)
                in_queue = block_id in self.manager.free_block_ids()
                assert in_queue == (ref == 0), f"block {block_id}: free xor used violated"

        @invariant()
        def every_sequence_reads_its_own_tokens(self) -> None:
            for seq in self.seqs.values():
                for pos, value in enumerate(seq.tokens):
                    slot = seq.table[pos // self.size] * self.size + pos % self.size
                    assert self.cache.get(slot) == value, f"slot {slot} lost position {pos}"

    return BlockManagerMachine
