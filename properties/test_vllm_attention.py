"""vLLM's Triton unified attention agrees with ours (``properties/vllm_attention.py``, run in
``.venv-vllm`` under ``pytest -m long``, nothing skipped; a missing vLLM is a failure)."""

from __future__ import annotations

import pytest

from properties import vllm_env
from properties.test_vllm_conformance import passed_in_vllm_env


@pytest.mark.long
def test_vllm_unified_attention_agrees_with_ours() -> None:
    passed_in_vllm_env(
        lambda: vllm_env.run_pytest("properties/vllm_attention.py", "--hypothesis-profile=ci")
    )
