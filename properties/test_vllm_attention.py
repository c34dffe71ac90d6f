"""vLLM's Triton attention agrees with ours: ``properties/vllm_attention.py`` in ``.venv-vllm``."""

from __future__ import annotations

import pytest

from properties import vllm_env
from properties.test_vllm_conformance import passed_in_vllm_env


@pytest.mark.long
def test_vllm_unified_attention_agrees_with_ours() -> None:
    passed_in_vllm_env(
        lambda: vllm_env.run_pytest("properties/vllm_attention.py", "--hypothesis-profile=ci")
    )
