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


@given(counts=st.lists(st.integers(0, 500), max_size=20), block_size=st.integers(1, 256))
def test_paged_waste_is_below_one_block_per_request(counts, block_size) -> None:
    usage = paged_usage(counts, block_size)
    assert all(0 <= waste < block_size for waste in usage.waste_per_request)
    assert usage.wasted_slots == sum(usage.waste_per_request)
    assert usage.reserved_slots % block_size == 0


@given(counts=st.lists(st.integers(0, 500), min_size=1, max_size=20), block_size=st.integers(1, 16))
def test_paged_never_reserves_more_than_a_contiguous_max_reservation(counts, block_size) -> None:
    """With max_len rounded up to whole blocks, paging is never worse than reserving max_len."""
    max_len = -(-max(counts) // block_size) * block_size
    assert (
        paged_usage(counts, block_size).reserved_slots
        <= contiguous_usage(counts, max_len).reserved_slots
    )


@given(counts=st.lists(st.integers(0, 500), max_size=20), spare=st.integers(0, 50))
def test_contiguous_waste_is_the_unused_reservation(counts: list[int], spare: int) -> None:
    max_len = max(counts, default=0) + spare
    usage = contiguous_usage(counts, max_len)
    assert usage.waste_per_request == tuple(max_len - count for count in counts)
    assert usage.wasted_slots == sum(usage.waste_per_request)


@pytest.mark.parametrize(
    ("call", "error"),
    [(lambda: contiguous_usage([1], -1), ValueError),
     (lambda: contiguous_usage([1], True), TypeError),
     (lambda: paged_usage([1], 0), ValueError), (lambda: paged_usage([1], 2.0), TypeError)],
)  # fmt: skip
def test_bad_reservations_and_block_sizes_are_refused(call: Any, error: type) -> None:
    with pytest.raises(error):
        call()


def test_usage_is_immutable() -> None:
    with pytest.raises(FrozenInstanceError):
        paged_usage([1], 4).used_slots = 0  # type: ignore[misc]


def test_contiguous_rejects_requests_longer_than_the_reservation() -> None:
    with pytest.raises(ValueError, match="exceed the reservation"):
        contiguous_usage([10, 60], max_len=50)


def test_run_py_prints_the_chapters_expected_output_line_by_line() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "run.py")],
        capture_output=True, text=True, check=True, encoding="utf-8", cwd=ROOT,
    )  # fmt: skip
    expected = GOLDEN.read_text(encoding="utf-8").splitlines()
    actual = result.stdout.splitlines()
    for number, (want, got) in enumerate(zip(expected, actual, strict=False), start=1):
        assert got == want, f"line {number} differs"
    assert len(actual) == len(expected)


@pytest.mark.skipif(not SEED.exists(), reason="the design chapter is not beside this checkout")
def test_golden_file_is_the_chapters_expected_output() -> None:
    chapter = SEED.read_text(encoding="utf-8")
    assert GOLDEN.read_text(encoding="utf-8").strip("\n") in chapter
