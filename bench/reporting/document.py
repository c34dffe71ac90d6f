"""The generated section of docs/results.md: rendering it from a run, and putting it in place.

The section lies between :data:`BEGIN` and :data:`END`; :func:`write` rewrites only it (appended
if absent; the file is created if missing) and the PNGs of :data:`~bench.reporting.figures.PLOTS`.
Sections whose benchmarks are not in the run are left out.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from bench.reporting.differences import differences_section
from bench.reporting.figures import PLOTS
from bench.reporting.markdown import reflow
from bench.reporting.run import Run
from bench.reporting.sections import (
    header_section,
    latency_section,
    lifetime_section,
    workloads_section,
)
from bench.reporting.serving import serving_section

BEGIN = "<!-- BEGIN generated: bench/report.py -->"
END = "<!-- END generated: bench/report.py -->"
HEADER = """# pagedkv results

Every figure here was produced by the command shown next to it.
"""
"""The start of a docs/results.md that does not exist yet."""


def render(run: Run, command: str) -> str:
    """The generated section for ``run``, made by ``command``, markers included."""
    sections = [
        header_section(run, command),
        workloads_section(),
        lifetime_section(run),
        serving_section(run),
        differences_section(run),
        latency_section(run),
    ]
    body = reflow("\n\n".join(section for section in sections if section))
    return f"{BEGIN}\n{body}{END}\n"


def splice(document: str, section: str) -> str:
    """``document`` with its generated section replaced by ``section`` (appended if absent)."""
    if BEGIN in document and END in document:
        before, rest = document.split(BEGIN, 1)
        after = rest.split(END, 1)[1].removeprefix("\n")
        return before + section + after
    return document.rstrip("\n") + "\n\n" + section


def write(run: Run, command: str, results: Path, figures: Path) -> None:
    """Draw every figure of ``run`` into ``figures`` and splice its rendered section into
    ``results`` (created from :data:`HEADER` if missing)."""
    figures.mkdir(parents=True, exist_ok=True)
    for plot in tqdm(PLOTS, desc="figures", unit="plot"):
        plot(run, figures)
    document = results.read_text() if results.exists() else HEADER
    results.write_text(splice(document, render(run, command)))
