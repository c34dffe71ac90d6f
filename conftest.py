"""Hypothesis profiles shared by `properties/` and `bench/`.

* ``dev``  (default): quick feedback while editing.
* ``ci``   (default when the ``CI`` environment variable is set): derandomized, no example
  database, at least 200 examples of up to 50 state-machine steps.
* ``deep``: a long hunt, at least 2000 examples of up to 200 steps.

Pick one explicitly with ``pytest --hypothesis-profile=NAME``.

Triton's mode is chosen here, before any test runs, by the rule ``pagedkv.kernels`` applies
when it first needs triton (the interpreter when ``TRITON_INTERPRET`` is unset and CUDA is
absent): Triton decides once, when it is imported, and ``torch._dynamo`` imports it (a test
that reaches it before the first triton-backend call would otherwise fix the compiled mode for
the rest of its process). Tests of the rule itself run it in fresh processes.
"""

import os

import torch
from hypothesis import HealthCheck, settings

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile(
    "dev",
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
)
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=2000,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
