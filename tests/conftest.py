"""Fixtures of both tiers; the helpers behind them are in fixtures/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures.helpers import RedisServer, kept_model

# One compute thread per process: two OpenMP threads on these VMs are much slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip the `gpu` tier where no CUDA device is."""
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA device (the gpu tier)")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def transformers_left_intact():
    """Fail the test that leaves transformers' loading no-ops in place (see
    pipeline_rl/scorers/hf.py, _LOADING) rather than the later tests whose models they break."""
    from transformers import PreTrainedModel

    before = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    yield
    after = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    assert after == before, "PreTrainedModel.tie_weights/init_weights were left replaced by this test"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return kept_model("tiny_model")
