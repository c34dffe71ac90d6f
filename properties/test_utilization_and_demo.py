"""Utilization figures come out of the spec, and ``python run.py`` prints the chapter's output."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.spec.utilization import contiguous_usage, paged_usage

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).with_name("golden") / "run_output.txt"
SEED = ROOT.parent / "shared" / "seed" / "000_4abb71376b24213d.txt"


def test_chapter_utilization_figures() -> None:
    counts = [30] * 8
    contiguous = contiguous_usage(counts, max_len=50)
    paged = paged_usage(counts, block_size=16)
    assert (contiguous.reserved_slots, contiguous.used_slots) == (400, 240)
    assert contiguous.utilization == pytest.approx(0.60)
    assert (paged.reserved_slots, paged.used_slots) == (256, 240)
    assert paged.utilization == pytest.approx(0.9375)
    assert paged.waste_per_request == (2,) * 8


@given(
    counts=st.lists(st.integers(0, 500), max_size=20),
    block_size=st.integers(1, 256),
    spare=st.integers(0, 50),
)
def test_waste_is_under_a_block_when_paged_and_the_unused_reservation_when_not(
    counts: list[int], block_size: int, spare: int
) -> None:
    """Paged waste is under one block a request; contiguous waste is what a reservation leaves
    unused; with max_len rounded up to whole blocks, paging never reserves more."""
    paged = paged_usage(counts, block_size)
    assert all(0 <= waste < block_size for waste in paged.waste_per_request)
    assert paged.reserved_slots % block_size == 0
    max_len = max(counts, default=0) + spare
    contiguous = contiguous_usage(counts, max_len)
    assert contiguous.waste_per_request == tuple(max_len - count for count in counts)
    for usage in (paged, contiguous):
        assert usage.wasted_slots == sum(usage.waste_per_request)
    rounded = -(-max(counts, default=0) // block_size) * block_size
    assert paged.reserved_slots <= contiguous_usage(counts, rounded).reserved_slots


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [(lambda: contiguous_usage([1], -1), ValueError, "max_len"),
     (lambda: contiguous_usage([1], True), TypeError, "max_len"),
     (lambda: contiguous_usage([10, 60], max_len=50), ValueError, "exceed the reservation"),
     (lambda: paged_usage([1], 0), ValueError, "block_size"),
     (lambda: paged_usage([1], 2.0), TypeError, "block_size"),
     (lambda: setattr(paged_usage([1], 4), "used_slots", 0), FrozenInstanceError, "used_slots")],
)  # fmt: skip
def test_bad_reservations_and_block_sizes_are_refused_and_usage_is_immutable(
    call: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


def test_run_py_prints_the_chapters_expected_output_line_by_line() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "run.py")],
        capture_output=True, text=True, check=True, encoding="utf-8", cwd=ROOT,
    )  # fmt: skip
    assert result.stdout.splitlines() == GOLDEN.read_text(encoding="utf-8").splitlines()


@pytest.mark.skipif(not SEED.exists(), reason="the design chapter is not beside this checkout")
def test_golden_file_is_the_chapters_expected_output() -> None:
    chapter = SEED.read_text(encoding="utf-8")
    assert GOLDEN.read_text(encoding="utf-8").strip("\n") in chapter
