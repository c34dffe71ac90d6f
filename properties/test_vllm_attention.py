"""vLLM's Triton unified attention beside ours, in ``.venv-vllm``, under ``pytest -m long``.

``properties/vllm_attention.py`` runs there (both kernels in the Triton interpreter, spec-run
paged caches, GQA, mixed batches, pure decode and sliding windows; fp16 and fp32) and must pass
with nothing skipped. A missing vLLM environment is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from properties import vllm_env
from properties.test_vllm_conformance import ensure_vllm_env, passed_in_vllm_env


@pytest.mark.long
def test_vllm_unified_attention_agrees_with_ours() -> None:
    ensure_vllm_env()
    args = ["-m", "pytest", "properties/vllm_attention.py", "-q", "-p", "no:cacheprovider"]
    done = vllm_env.run_in_env([*args, "--hypothesis-profile=ci"])
    passed_in_vllm_env(done, allow_deselected=False)
