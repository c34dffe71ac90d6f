"""The pieces of ``bench/report.py``, which renders a pytest-benchmark run of ``pytest bench``
into docs/results.md and docs/figures/.

Each module is one concept; a module imports only those listed before it:

* :mod:`bench.reporting.labels`: the policies the report compares, and their names;
* :mod:`bench.reporting.run`: a benchmark run (:class:`~bench.reporting.run.Run`) and its
  figures by key;
* :mod:`bench.reporting.markdown`: tables, number formats, re-wrapping;
* :mod:`bench.reporting.verdicts`: comparison words and orderings computed from numbers;
* :mod:`bench.reporting.sections`: the header, workloads, lifetime and latency sections;
* :mod:`bench.reporting.serving`: the serving simulation section;
* :mod:`bench.reporting.differences`: where the run's numbers differ from the paper's;
* :mod:`bench.reporting.figures`: the PNG plots;
* :mod:`bench.reporting.document`: the generated section of docs/results.md, and writing it;
* :mod:`bench.reporting.diff`: the deterministic figures that moved between two runs;
* :mod:`bench.reporting.runner`: ``pytest bench`` in-process, with a progress bar.

No sentence of the report that judges a number is fixed text: each is built from the numbers
it describes (:mod:`bench.reporting.verdicts`), so a new run cannot leave one stale.
"""
