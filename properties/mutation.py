"""Mutation testing: every small edit of ``spec/`` and ``impl/blocks/`` must fail a property.

``python -m properties.mutation [PATH ...] [--sample N] [--json FILE] [--markdown]``

A *mutant* is one source file with one small edit, made on its syntax tree (:func:`sites`): a
comparison's boundary (``<`` to ``<=``), ``==`` to ``!=``, ``is`` to ``is not``, ``in`` to
``not in``, ``+`` to ``-`` and other arithmetic swaps, ``and`` to ``or``, a dropped ``not`` or
unary minus, an int constant plus one, ``True`` to ``False``, ``min`` to ``max``, a negated
``if``/``while`` test, ``break`` to ``continue``, and a deleted call statement, augmented
assignment, ``raise`` or ``del``. Docstrings, annotations and f-strings (error messages) are
never edited: no property reads them.

Each mutant runs in a forked child of this process. The child puts an import hook in front of
every other (:class:`MutantFinder`), so the mutated module is what ``import`` returns, then runs
``pytest`` in-process on the block-management files of ``properties/``
(:data:`PYTEST_ARGS`): stop at the first failure, Hypothesis profile ``mutation``
(derandomized, no example database, no shrinking). No file is written, so the tree may change
under a run. A mutant is *killed* when pytest reports a failure (exit status 1, or 2 for an
error while collecting, which is the mutant failing at import) or runs past the timeout; it
*survives* when every test passes.
Before the mutants, the unmutated code must pass the same run (the baseline), and its time sets
the timeout. A surviving mutant is either a missing property or equivalent to the original; the
equivalent ones are listed in :data:`EQUIVALENT` with the reason, and docs/results.md explains
them. Linux only (``os.fork``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FOLDER_PACKAGES = {"spec": "pagedkv.spec", "impl": "pagedkv.impl"}
"""Top-level folders and the import names ``pyproject.toml`` gives them."""

DEFAULT_PATHS = (
    "spec/block_manager.py",
    "spec/prefix_cache.py",
    "spec/utilization.py",
    "impl/blocks/free_queue.py",
    "impl/blocks/manager.py",
    "impl/blocks/prefix_cache.py",
    "impl/blocks/table_store.py",
    "impl/blocks/growth.py",
    "impl/blocks/page_tables.py",
)
"""The files a full run mutates: the spec and the block-management modules of impl."""

BLOCK_MANAGEMENT_TESTS = (
    "properties/test_block_table_store.py",
    "properties/test_impl_differential.py",
    "properties/test_impl_edges.py",
    "properties/test_impl_free_queue.py",
    "properties/test_impl_prefix_cache.py",
    "properties/test_prefix_cache_spec.py",
    "properties/test_spec_examples.py",
    "properties/test_spec_machine.py",
    "properties/test_store_preemption.py",
    "properties/test_trusted_api.py",
    "properties/test_utilization_and_demo.py",
)
"""The property files a mutant run uses: those that check block management. Left out are the
other layers' tests (engine, kernels, scheduler, layers), the planted-bug tests (they check the
tests), and the exhaustive check (a minute per mutant; its own planted bugs show its teeth)."""

PYTEST_ARGS = (
    *BLOCK_MANAGEMENT_TESTS,
    "-x",
    "-q",
    "-p",
    "no:cacheprovider",
    "--hypothesis-profile=mutation",
)

MESSAGE_ONLY = "changes only which ids the error message lists; the same error is raised"
EQUIVALENT: dict[str, str] = {
    "spec/prefix_cache.py::default_block_hash::And->Or#1": (
        "the test only skips check_stable_extra for None and str, which it accepts anyway"
    ),
    "impl/blocks/manager.py::BlockManager.release_outside_window::Gt->GtE#1": (
        "with as many outside entries as released ones the held slice is empty: releasing no "
        "block changes nothing"
    ),
    "impl/blocks/table_store.py::BlockTableStore.release_outside_window::True->False#1": (
        "zip(..., strict=False): the batch's ids and the capacity flags have one entry per "
        "sequence by construction"
    ),
    "impl/blocks/table_store.py::BlockTableStore.release_outside_window::1->2#3": (
        "reshape(-2): numpy infers a dimension given any negative size, so it is the same flat view"
    ),
    "impl/blocks/table_store.py::BlockTableStore.release_outside_window::BitAnd->BitOr#1": (
        "flagging more rows tail-shared only routes their next growth through grow's general "
        "path, which decides the same growth (the flag is conservative by design)"
    ),
    "impl/blocks/table_store.py::SeqBatch::False->True#4": (
        "eq=True: no batch is ever compared or hashed"
    ),
    "impl/blocks/table_store.py::SeqBatch::True->False#2": (
        "slots=False: only the instance's memory layout changes; nothing reads __dict__ or "
        "__slots__"
    ),
    "impl/blocks/table_store.py::BlockTableStore.__init__::0->1#1": (
        "an epoch that starts at 1: a batch's epoch is only compared for equality with its own "
        "store's, and every remove bumps it"
    ),
    "impl/blocks/table_store.py::BlockTableStore.__init__::0->1#2": (
        "a tail-shared count that starts at 1 never reaches 0, so every growth takes grow's "
        "general path, which decides the same growth (the count only gates the fast path)"
    ),
    "impl/blocks/table_store.py::BlockTableStore.admit::Eq->NotEq#1": (
        "the refused prompt's keys depend on its tokens and extra key, not on its sequence "
        "id: reusing them for another id, or recomputing them, gives the same keys"
    ),
    "impl/blocks/table_store.py::BlockTableStore.truncate::True->False#1": (
        "zip(..., strict=False): the ids, counts and token counts have one entry per sequence "
        "by construction"
    ),
    "impl/blocks/table_store.py::BlockTableStore.truncate::Gt->GtE#2": MESSAGE_ONLY,
    "impl/blocks/table_store.py::BlockTableStore.truncate::True->False#2": (
        "zip(..., strict=False): the cut rows' indices and their last blocks are read from "
        "the same rows"
    ),
    "impl/blocks/table_store.py::BlockTableStore.truncate::True->False#3": (
        "zip(..., strict=False): the counts are broadcast to one per sequence"
    ),
    "impl/blocks/table_store.py::BlockTableStore.truncate::delete-Expr#5": (
        "the cut rows keep their tail-shared flags from before: the flag only routes a row's "
        "next growth through grow's general path, which decides the same growth"
    ),
    "impl/blocks/table_store.py::BlockTableStore.grow::True->False#1": (
        "zip(..., strict=False): the plan has one verdict per sequence of the batch"
    ),
    "impl/blocks/table_store.py::BlockTableStore.truncate::Gt->GtE#3": (
        "cutting a sequence's key state at the count it already holds keeps every key; it "
        "only drops the unkeyed tokens of a partial block, which the next cache_blocks checks "
        "again"
    ),
    "impl/blocks/table_store.py::BlockTableStore._check_live::delete-Raise#1": (
        "the dict lookup that follows raises KeyError for an unknown id all the same; only "
        "the message differs"
    ),
    "impl/blocks/table_store.py::BlockTableStore._token_array::LtE->Lt#1": (
        "a count of 0 then takes the general check, which returns the same 0 (the fast path "
        "is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._token_array::0->1#1": (
        "a count of 0 then takes the general check, which returns the same 0 (the fast path "
        "is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._token_array::LtE->Lt#2": (
        "a count of int32's largest then takes the general check, which returns it too (the "
        "fast path is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._token_array::0->1#3": (
        "counts with a 0 then take the per-count check, which accepts them (the fast path is "
        "an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore.slot_mapping::False->True#1": (
        "astype(copy=True): the slots are a new array already; a copy holds the same values"
    ),
    "impl/blocks/table_store.py::BlockTableStore._token_array::Lt->LtE#1": (
        "counts with a 0 then take the per-count check, which accepts them (the fast path is "
        "an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._release_rows::drop-USub#2": (
        "which free row the next sequence takes is not part of the store's contract: every "
        "sequence's table, counts and blocks are the same in any row"
    ),
    "impl/blocks/table_store.py::BlockTableStore._cut_rows::Lt->LtE#2": (
        "the extra column is each row's first padding entry, which the release filters out "
        "and which is padding again after"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::BitOr->BitAnd#1": (
        "clearing the tail-shared flag of fewer rows only routes their next growth through "
        "grow's general path, which decides the same growth"
    ),
    "impl/blocks/table_store.py::_SeqKeys::False->True#1": (
        "eq=True: no key state is ever compared"
    ),
    "impl/blocks/table_store.py::_Growth::False->True#1": (
        "eq=True: no growth plan is ever compared or hashed"
    ),
    "impl/blocks/table_store.py::_Growth.fits_at_once::And->Or#2": (
        "any batch with a copy on write then grows in order, which decides the same growth "
        "(growing at once is an optimization)"
    ),
    "impl/blocks/table_store.py::_Growth::True->False#1": (
        "frozen=False: nothing assigns to a growth plan's fields after it is made"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_decode::Eq->NotEq#2": (
        "rows.size != 0 sends every non-empty batch to grow's general path, which decides the "
        "same growth (the decode path is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._release_rows::Gt->GtE#1": (
        "rows.size >= 1 in the elif: a single row already took the branch before it"
    ),
    "impl/blocks/table_store.py::BlockTableStore._keyed_in_place::BitAnd->BitOr#2": (
        "candidates | isin(last, cached): cached holds only candidates' last blocks, and a "
        "row whose last block is a candidate's shares it, so it writes no block in place and "
        "is no candidate: no other row can match"
    ),
    "impl/blocks/table_store.py::BlockTableStore._clear_tail_shared::negate-if-test#1": (
        "flags that are never cleared only route more growths through grow's general path, "
        "which decides the same growth (the flag is conservative by design)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::0->1#3": (
        "_take_fresh reads total only without keyed blocks; with them each sequence takes its "
        "own count"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::BitOr->BitAnd#2": (
        "clearing the tail-shared flag of fewer rows only routes their next growth through "
        "grow's general path, which decides the same growth"
    ),
    "impl/blocks/table_store.py::BlockTableStore._release_rows::delete-Expr#3": (
        "a freed row keeps its tail-shared flag: the flag only routes its next sequence's "
        "growth through grow's general path, which decides the same growth"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_or_preempt_in_order::True->False#1": (
        "zip(..., strict=False): one step per sequence of the batch by construction"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_or_preempt_in_order::break->continue#1": (
        "ids only shrink, so once an index is past them every later one is too: skipping "
        "them one by one ends the loop with the same victims"
    ),
    "impl/blocks/table_store.py::BlockTableStore._release_rows::Add->Sub#1": (
        "an epoch that falls by one at each remove still takes a new value at each, which is "
        "all a batch's epoch check needs"
    ),
    "impl/blocks/table_store.py::BlockTableStore._release_rows::1->2#5": (
        "an epoch that rises by two at each remove still takes a new value at each, which is "
        "all a batch's epoch check needs"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::0->1#4": (
        "a row that grew by one block without writing its last keeps its tail-shared flag: the "
        "flag only routes its next growth through grow's general path, which decides the same "
        "growth"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::delete-Expr#3": (
        "flags never cleared after a write only route those rows' next growth through grow's "
        "general path, which decides the same growth (the flag is conservative by design)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::0->1#5": (
        "a row that grew by one block without writing its last keeps its tail-shared flag: the "
        "flag only routes its next growth through grow's general path, which decides the same "
        "growth"
    ),
    "impl/blocks/table_store.py::_SeqKeys::True->False#1": (
        "slots=False: only the instance's memory layout changes; nothing reads __dict__ or "
        "__slots__"
    ),
    "impl/blocks/table_store.py::::1->2#3": (
        "a 'nothing refused' sentinel with id -2 matches only sequence -2 retrying an empty "
        "prompt without an extra key, whose keys are the empty tuple the sentinel holds"
    ),
    "impl/blocks/table_store.py::_Growth.fits_at_once::LtE->Lt#1": (
        "a batch that needs exactly the free blocks then grows in order, which decides the "
        "same growth (growing at once is an optimization)"
    ),
    "impl/blocks/table_store.py::_Growth::True->False#2": (
        "slots=False: only the instance's memory layout changes; nothing reads __dict__ or "
        "__slots__"
    ),
    "impl/blocks/table_store.py::_repeats::Or->And#1": MESSAGE_ONLY,
    "impl/blocks/table_store.py::_SeqKeys.extends::Lt->LtE#1": (
        "a call with exactly the keyed tokens then starts over, which keys and registers the "
        "same blocks (the incremental path is an optimization)"
    ),
    "impl/blocks/table_store.py::_SeqKeys.extends::Eq->NotEq#2": (
        "the branches swapped compare a longer list whole, which fails: the registration then "
        "starts over, which keys and registers the same blocks (the incremental path is an "
        "optimization)"
    ),
    "impl/blocks/table_store.py::_SeqKeys.cut::delete-Delete#2": (
        "the keyed tokens past the cut kept: a registration whose tokens differ there starts "
        "over, one that repeats them extends the cut keys; both key the same blocks"
    ),
    "impl/blocks/table_store.py::BlockTableStore._cut_rows::Lt->LtE#1": (
        "kept <= lengths also enters the release for rows that drop nothing: an empty mask "
        "releases no block"
    ),
    "impl/blocks/table_store.py::BlockTableStore._clear_tail_shared::False->True#1": (
        "setting the flags it should clear only routes those rows' next growth through grow's "
        "general path, which decides the same growth (the flag is conservative by design)"
    ),
    "impl/blocks/table_store.py::::drop-USub#2": (
        "a 'nothing refused' sentinel with id 1 matches only sequence 1 retrying an empty "
        "prompt without an extra key, whose keys are the empty tuple the sentinel holds"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::1->2#1": (
        "reshape(-2): numpy infers a dimension given any negative size, so it is the same flat view"
    ),
    "impl/blocks/table_store.py::BlockTableStore._apply_growth::negate-if-test#3": (
        "flags left uncleared after a write only route those rows' next growth through grow's "
        "general path, which decides the same growth; with no flag the clear does nothing"
    ),
    "impl/blocks/table_store.py::_repeats::In->NotIn#1": MESSAGE_ONLY,
    "impl/blocks/table_store.py::BlockTableStore._grow_decode::0->1#1": (
        "rows.size == 1 sends a one-sequence batch to grow's general path, which decides the "
        "same growth (the decode path is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_decode::And->Or#2": (
        "declining the decode path whenever any row is flagged, in the batch or not, only "
        "routes more growths through grow's general path, which decides the same growth"
    ),
    "impl/blocks/table_store.py::BlockTableStore._growth::Gt->GtE#2": MESSAGE_ONLY,
    "impl/blocks/table_store.py::BlockTableStore._plan_preemption::True->False#1": (
        "zip(..., strict=False): a victim's blocks and their reference counts are read alike"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_decode::Gt->GtE#1": (
        "with exactly as many sequences at a boundary as free blocks the decode path declines "
        "and grow's general path decides the same growth (the decode path is an optimization)"
    ),
    "impl/blocks/table_store.py::BlockTableStore._growth::True->False#1": (
        "zip(..., strict=False): the batch's ids and the blocks they need have one entry per "
        "sequence"
    ),
    "impl/blocks/table_store.py::BlockTableStore._grow_decode::1->2#3": (
        "reshape(-2): numpy infers a dimension given any negative size, so it is the same flat view"
    ),
    "impl/blocks/prefix_cache.py::PromptPlan::True->False#1": (
        "frozen=False: nothing assigns to a plan's fields after it is made"
    ),
    "impl/blocks/prefix_cache.py::PromptPlan::False->True#1": (
        "eq=True: no plan is ever compared or hashed"
    ),
    "impl/blocks/prefix_cache.py::PrefixCachingBlockManager.register_table_blocks::True->False#1": (
        "zip(..., strict=False): both callers pass one key per block, sliced alike"
    ),
    "impl/blocks/prefix_cache.py::PrefixCachingBlockManager.register_table_blocks::True->False#2": (
        "zip(..., strict=False): the blocks, their keys and the keys' holders have one entry "
        "per block by construction"
    ),
    "impl/blocks/prefix_cache.py::PrefixCachingBlockManager.take_blocks::And->Or#1": (
        "evicted or enable_kv_events: with events off the evicted keys are removed in queue "
        "order instead of set order, which leaves the same key maps; with events on and none "
        "evicted the list is empty either way"
    ),
    "spec/block_manager.py::BlockManager._check_live_table::Gt->GtE#1": MESSAGE_ONLY,
    "spec/block_manager.py::BlockManager._check_live_table::1->2#1": MESSAGE_ONLY,
    "spec/block_manager.py::BlockManager.append_slot::True->False#1": (
        "zip(..., strict=False): the two lists have equal length by construction"
    ),
    "impl/blocks/growth.py::plan_in_order::True->False#1": (
        "zip(..., strict=False): the four arrays have one entry per sequence by construction"
    ),
    "impl/blocks/growth.py::has_repeats::False->True#1": (
        "a batch of fewer than two shared writers then takes the in-order plan, which decides "
        "the same growth (the fast path is an optimization, exact either way)"
    ),
    "spec/utilization.py::paged_usage::True->False#1": (
        "zip(..., strict=False): allocated has one entry per count by construction"
    ),
    "spec/prefix_cache.py::BlockKey::False->True#1": (
        "field(compare=True): with eq=False and no ordering, no generated method reads it"
    ),
    "spec/prefix_cache.py::BlockKey::False->True#2": (
        "@dataclass(eq=True): dataclass keeps the class's own __eq__ and explicit __hash__"
    ),
    "impl/blocks/free_queue.py::::1->2#1": (
        "TOMBSTONE = -2: every use goes through the constant, and any negative value is no id"
    ),
    "impl/blocks/free_queue.py::FreeBlockQueue.__init__::1->2#2": (
        "a ring one slot longer for pools under 4 blocks: the ring's size only decides when "
        "compaction runs, and compaction keeps the queue's order"
    ),
    "impl/blocks/free_queue.py::FreeBlockQueue.push_one::Eq->NotEq#1": (
        "compacting before every push except into a full ring: after a compaction the ring "
        "holds at most num_blocks slots, so a push never meets a full ring, and compaction "
        "keeps the order"
    ),
    "impl/blocks/free_queue.py::FreeBlockQueue.extend::Gt->GtE#1": (
        "compacting also when the ids would exactly fill the ring: compaction keeps the order"
    ),
    "impl/blocks/free_queue.py::FreeBlockQueue.extend::LtE->Lt#1": (
        "ids that end exactly at the ring's end take the wrap-around branch, whose second "
        "slice is then empty: the same writes"
    ),
    "impl/blocks/free_queue.py::FreeBlockQueue._read::LtE->Lt#1": (
        "a read that ends exactly at the ring's end concatenates an empty second slice: the "
        "same ids"
    ),
    "impl/blocks/manager.py::BlockManager.append_slot::Lt->LtE#1": (
        "with first_written == stop_written the slice is empty, so no block is shared either way"
    ),
    "impl/blocks/manager.py::BlockManager.append_slot::True->False#1": (
        "zip(..., strict=False): the indices and fresh ids have one entry per copy by construction"
    ),
    "impl/blocks/manager.py::BlockManager.truncate::Lt->LtE#1": (
        "releasing the empty tail of a table that keeps every block changes nothing"
    ),
    "impl/blocks/manager.py::BlockManager._live_array::False->True#1": (
        "astype(copy=True): the ids are only read afterwards, so a copy changes nothing"
    ),
    "impl/blocks/manager.py::BlockManager._distinct_and_held::Gt->GtE#1": (
        "has_repeats of a single id is False, so checking it changes nothing"
    ),
    "impl/blocks/manager.py::BlockManager.release_blocks_in_order::1->2#2": (
        "every last-occurrence position shifts by the same constant, so argsort's order stays"
    ),
    "impl/blocks/manager.py::BlockManager.release_blocks_in_order::Sub->Add#3": (
        "ids.size + 1 - first for ids.size - 1 - first: the same constant shift"
    ),
    "impl/blocks/manager.py::BlockManager.pending_copy_pairs_array::Gt->GtE#1": (
        "concatenating a single chunk gives the same pairs"
    ),
}
"""Surviving mutants that behave exactly as the original, by id, with the reason (in
docs/results.md at length)."""

# ----------------------------------------------------------------- the edits

COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
ARITHMETIC_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitOr,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
DELETABLE = (ast.Expr, ast.AugAssign, ast.Raise, ast.Delete)


@dataclass(frozen=True)
class Site:
    """One edit: ``parent.field`` (at ``index`` when that field is a list) becomes ``new``."""

    parent: ast.AST
    field: str
    index: int | None
    new: ast.AST
    operator: str  # what the edit does, e.g. "Lt->LtE"
    line: int
    scope: str  # the enclosing class and function, dotted ("" at module level)


def _name(op: ast.AST) -> str:
    return type(op).__name__


def _edits(node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """The replacements of ``node`` (each a new node) and what each does."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAPS:
                swapped = COMPARE_SWAPS[type(op)]()
                new = copy.copy(node)
                new.ops = [*node.ops[:i], swapped, *node.ops[i + 1 :]]
                yield new, f"{_name(op)}->{_name(swapped)}"
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in ARITHMETIC_SWAPS:
        new = copy.copy(node)
        new.op = ARITHMETIC_SWAPS[type(node.op)]()
        yield new, f"{_name(node.op)}->{_name(new.op)}"
    elif isinstance(node, ast.BoolOp):
        swapped = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield ast.BoolOp(swapped, node.values), f"{_name(node.op)}->{_name(swapped)}"
    elif isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.UAdd):
        yield node.operand, f"drop-{_name(node.op)}"
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield ast.Constant(not node.value), f"{node.value}->{not node.value}"
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield ast.Constant(node.value + 1), f"{node.value}->{node.value + 1}"
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("min", "max")
    ):
        other = "max" if node.func.id == "min" else "min"
        yield (
            ast.Call(ast.Name(other, ast.Load()), node.args, node.keywords),
            f"{node.func.id}->{other}",
        )
    elif isinstance(node, ast.Break):
        yield ast.Continue(), "break->continue"
    if isinstance(node, (ast.If, ast.While)) and not isinstance(
        node.test, (ast.Compare, ast.BoolOp)
    ):
        negated = copy.copy(node)
        negated.test = ast.UnaryOp(ast.Not(), node.test)
        yield negated, f"negate-{_name(node).lower()}-test"
    if isinstance(node, DELETABLE):
        yield ast.Pass(), f"delete-{_name(node)}"


def _is_docstring(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _skipped_fields(node: ast.AST) -> set[str]:
    """Fields of ``node`` that are never edited: annotations (no runtime effect here)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"returns"}
    if isinstance(node, ast.arg):
        return {"annotation"}
    if isinstance(node, ast.AnnAssign):
        return {"annotation"}
    return set()


def sites(tree: ast.Module) -> list[Site]:
    """Every edit of ``tree``, in a fixed order (the same for a deep copy of it)."""
    found: list[Site] = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, ast.JoinedStr) or _is_docstring(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        for field, value in ast.iter_fields(node):
            if field in _skipped_fields(node):
                continue
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if not isinstance(child, ast.AST) or _is_docstring(child):
                    continue
                for new, operator in _edits(child):
                    position = index if isinstance(value, list) else None
                    line = getattr(child, "lineno", getattr(node, "lineno", 0))
                    found.append(Site(node, field, position, new, operator, line, scope))
                visit(child, scope)

    visit(tree, "")
    return found


def apply(site: Site) -> None:
    """Make the edit in place."""
    if site.index is None:
        setattr(site.parent, site.field, site.new)
    else:
        getattr(site.parent, site.field)[site.index] = site.new


@dataclass(frozen=True)
class Mutant:
    """One edit of one file. ``ident`` is stable while the edited function keeps its code."""

    path: str  # relative to the repository root
    index: int  # position among the file's sites
    ident: str  # path::scope::operator#occurrence within that scope
    line: int
    operator: str


def module_name(path: str) -> str:
    """The import name of a repository file: ``spec/prefix_cache.py`` is
    ``pagedkv.spec.prefix_cache``."""
    folder, *rest = Path(path).with_suffix("").parts
    return ".".join((FOLDER_PACKAGES[folder], *rest))


def mutants_of(path: str) -> list[Mutant]:
    """Every mutant of one file, in site order."""
    tree = ast.parse((ROOT / path).read_text(), path)
    seen: Counter[str] = Counter()
    result = []
    for index, site in enumerate(sites(tree)):
        key = f"{path}::{site.scope}::{site.operator}"
        seen[key] += 1
        result.append(Mutant(path, index, f"{key}#{seen[key]}", site.line, site.operator))
    return result


def mutated_code(mutant: Mutant) -> types.CodeType:
    """The mutant's module, compiled under the real file name (so tracebacks point there)."""
    source_path = ROOT / mutant.path
    tree = ast.parse(source_path.read_text(), str(source_path))
    apply(sites(tree)[mutant.index])
    return compile(ast.fix_missing_locations(tree), str(source_path), "exec")


# ----------------------------------------------------------------- running one mutant


class MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: module ``name`` is executed from ``code`` instead of its file."""

    def __init__(self, name: str, path: Path, code: types.CodeType) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=str(self.path))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__file__ = str(self.path)
        exec(self.code, module.__dict__)


def register_profile() -> None:
    """The Hypothesis profile of a mutant run: reproducible, and it only has to find a bug."""
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile(
        "mutation",
        max_examples=50,
        stateful_step_count=30,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )


def run_pytest(code: tuple[str, types.CodeType] | None, timeout: float) -> tuple[str, float]:
    """Run :data:`PYTEST_ARGS` in a forked child with ``code = (module, compiled mutant)``
    installed (or nothing, for the baseline). Returns ``(verdict, seconds)``: ``"passed"``,
    ``"failed"`` (a test failed or collection broke), ``"timeout"`` or ``"error: N"`` for
    another pytest exit status."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.setpgid(0, 0)  # its own process group, so a timeout ends what it started
        status = 3
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if code is not None:
                name, compiled = code
                sys.meta_path.insert(0, MutantFinder(name, Path(compiled.co_filename), compiled))
            import pytest

            status = int(pytest.main(list(PYTEST_ARGS)))
        finally:
            os._exit(status)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        elapsed = time.monotonic() - start
        if done:
            code_ = os.waitstatus_to_exitcode(status)
            verdict = {0: "passed", 1: "failed", 2: "failed"}.get(code_, f"error: {code_}")
            return verdict, elapsed
        if elapsed > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", elapsed
        time.sleep(0.02)


@dataclass
class Result:
    """A mutant and what became of it: ``killed``, ``timeout`` (also a kill) or ``survived``."""

    ident: str
    path: str
    line: int
    operator: str
    verdict: str
    seconds: float


def run(mutants: list[Mutant], timeout: float, progress: Callable[[Result], None]) -> list[Result]:
    """Run each mutant; ``progress`` sees each result as it comes."""
    results = []
    for mutant in mutants:
        verdict, seconds = run_pytest((module_name(mutant.path), mutated_code(mutant)), timeout)
        if verdict.startswith("error"):
            raise RuntimeError(f"{mutant.ident}: pytest ended with {verdict}")
        outcome = {"failed": "killed", "passed": "survived"}.get(verdict, verdict)
        result = Result(mutant.ident, mutant.path, mutant.line, mutant.operator, outcome, seconds)
        progress(result)
        results.append(result)
    return results


def score_table(results: list[Result]) -> str:
    """Markdown: per file, mutants, killed, survivors (equivalent or not) and the score."""
    lines = [
        "| file | mutants | killed | equivalent | missing a property "
        "| score | score less equivalent |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in dict.fromkeys(r.path for r in results):
        mine = [r for r in results if r.path == path]
        killed = sum(r.verdict != "survived" for r in mine)
        equivalent = sum(r.verdict == "survived" and r.ident in EQUIVALENT for r in mine)
        other = len(mine) - killed - equivalent
        less = f"{100 * killed / (len(mine) - equivalent):.1f}%" if other + killed else "-"
        lines.append(
            f"| `{path}` | {len(mine)} | {killed} | {equivalent} | {other} | "
            f"{100 * killed / len(mine):.1f}% | {less} |"
        )
    return "\n".join(lines)


def sample(mutants: list[Mutant], count: int) -> list[Mutant]:
    """``count`` mutants spread evenly over the list (the same ones every time)."""
    if count >= len(mutants):
        return mutants
    return [mutants[i * len(mutants) // count] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    """The command. Exit status 0 when every mutant is killed or listed in :data:`EQUIVALENT`."""
    parser = argparse.ArgumentParser(prog="python -m properties.mutation", description=__doc__)
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS), help="files to mutate")
    parser.add_argument("--sample", type=int, help="run only this many mutants, spread evenly")
    parser.add_argument("--only", nargs="+", default=[], help="run only these mutant ids")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument("--markdown", action="store_true", help="print the score table")
    args = parser.parse_args(argv)
    mutants = [m for path in args.paths for m in mutants_of(path)]
    if args.only:
        mutants = [m for m in mutants if m.ident in args.only]
    if args.sample:
        mutants = sample(mutants, args.sample)
    if args.list:
        for mutant in mutants:
            print(f"{mutant.ident}  (line {mutant.line})")
        return 0
    os.chdir(ROOT)
    register_profile()
    import numpy  # noqa: F401  (imported once here, not again in every child)
    import pytest  # noqa: F401

    verdict, seconds = run_pytest(None, timeout=600)
    if verdict != "passed":
        print(f"the unmutated code does not pass: {verdict}", file=sys.stderr)
        return 2
    timeout = 3 * seconds + 10
    print(f"baseline passed in {seconds:.1f} s; {len(mutants)} mutants, timeout {timeout:.0f} s")

    def progress(result: Result) -> None:
        if result.verdict == "survived":
            note = EQUIVALENT.get(result.ident, "NOT EQUIVALENT: a property is missing")
            print(f"survived  {result.ident} (line {result.line}): {note}", flush=True)

    results = run(mutants, timeout, progress)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(score_table(results) if args.markdown else f"{len(results)} mutants run")
    missing = [r for r in results if r.verdict == "survived" and r.ident not in EQUIVALENT]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
