"""``pytest bench`` in this process, writing a benchmark JSON, with a progress bar."""

from __future__ import annotations

from pathlib import Path

import pytest
from tqdm import tqdm


class Progress:
    """A pytest plugin driving a tqdm bar: one tick per test; failures are printed as they
    happen and collected in :attr:`failed`."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.failed: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.bar.reset(total=len(session.items))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
            tqdm.write(f"FAILED {report.nodeid}\n{report.longreprtext[-2000:]}")
        if report.when == "teardown":
            self.bar.set_postfix_str(report.nodeid.rsplit("::", 1)[-1][:48], refresh=False)
            self.bar.update(1)


def run_benchmarks(json_path: Path) -> None:
    """``pytest bench --benchmark-json=json_path`` from the current directory (the repository
    root); exits naming the failed tests if any fails."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    # The bar replaces pytest's terminal output (and addopts' terminal options with it).
    quiet = ["-p", "no:terminal", "-o", "addopts=", "-p", "no:cacheprovider"]
    args = ["bench", *quiet, f"--benchmark-json={json_path}"]
    with tqdm(desc="pytest bench", unit="test") as bar:
        progress = Progress(bar)
        code = pytest.main(args, plugins=[progress])
    if code != 0:
        raise SystemExit(f"pytest bench failed ({code}): {progress.failed}")
