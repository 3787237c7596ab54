"""The weight-swap hook refuses vLLM releases it was not built on, before an engine starts."""

import pytest

from pipeline_rl.engine.vllm_hook import SUPPORTED_VLLM, check_vllm_version


def test_the_supported_release_passes_and_others_are_refused_by_name():
    check_vllm_version(f"{SUPPORTED_VLLM}.0")
    check_vllm_version(f"{SUPPORTED_VLLM}.1+cpu")
    for other in ("0.33.0", "0.3.2", "1.32.0"):
        with pytest.raises(RuntimeError, match=rf"vLLM {other} is installed.*vllm=={SUPPORTED_VLLM}\.0"):
            check_vllm_version(other)
