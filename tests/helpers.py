"""Helpers shared by the test tiers: paths, free ports, a real redis-server, the tiny model.

Tests import these with `from helpers import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_rl.wire import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CACHE = Path(os.environ.get(CACHE_ENV, ROOT / ".cache"))


PORT_RANGE = (20000, 32767)
"""Where test servers listen: below the kernel's ephemeral range (32768-60999 by default, where
port 0 and outgoing connections draw from, so a port found free there can be taken before the
server binds it; a Ray cluster makes hundreds of connections) and above Ray's worker ports
(10002-19999)."""
_handed_out: set[int] = set()


def free_port() -> int:
    """A port no process listens on, never the same twice in one test session."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


class RedisServer:
    """A redis-server process of the test's own; `restart()` keeps the port. With `appendonly` it
    loads (and keeps) the append-only file under `workdir`, as the launcher's own server does."""

    def __init__(self, workdir: Path, appendonly: bool = False):
        self.port = free_port()
        self.workdir = workdir
        self.appendonly = appendonly
        self.proc = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH (.ci/run installs it with apt)")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def build_tiny_model() -> Path:
    """The pretrained tiny arithmetic model under CACHE/tiny_model (built once, with its data set
    under CACHE/arithmetic)."""
    path = CACHE / "tiny_model"
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--cache", str(CACHE)], check=True
        )
    return path


def perturbed(weights: dict, seed: int) -> dict:
    """Another model of the same shapes: each matrix plus noise of its own scale, each vector
    (norms, biases) scaled by random factors (the tiny model's softened final norm included)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        name: t + torch.randn(t.shape, generator=g) * t.std()
        if t.dim() > 1
        else t * (1 + 0.5 * torch.randn(t.shape, generator=g))
        for name, t in weights.items()
    }


def hf_model(model_dir, weights: dict):
    """A transformers model of `model_dir`'s architecture holding `weights` (or its own: {})."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    return model


def random_qwen2(attn: str | None = None, max_len: int = 128):
    """A tiny Qwen2 with random weights (seed 0): contracts that hold for any causal LM are
    checked on it."""
    import torch
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    torch.manual_seed(0)
    config = qwen2_config(97, hidden=32, layers=2, intermediate=64, max_len=max_len)
    if attn is not None:
        config._attn_implementation = attn
    return Qwen2ForCausalLM(config).eval()


def record_messages(endpoint, events: list[str], label) -> None:
    """Make a weight-sync endpoint log each message it starts ("send X" / "start X") and each
    one it waits for ("done X") into `events`; `label(buffer)` names a message."""
    start = endpoint._start

    class Work:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self, timeout):
            self.work.wait(timeout)
            events.append(f"done {self.name}")

    def started(buffer):
        name, kind = label(buffer)
        events.append(f"{kind} {name}")
        return Work(start(buffer), name)

    endpoint._start = started


def peft_model(model_dir, adapter: dict, lora):
    """The tiny model at `model_dir` with peft adapters of config `lora` holding `adapter`
    (tensors by PEFT's saved names)."""
    from peft import set_peft_model_state_dict

    from pipeline_rl.lora import wrap

    model = wrap(hf_model(model_dir, {}), lora)
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def random_adapter(shapes: dict, seed: int, scale: float = 0.3) -> dict:
    """Adapter tensors of `shapes` (name -> shape), normal with std `scale` (A and B alike: a
    delta of the same order as the tiny model's weights, so that it changes greedy choices)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in shapes.items()}


def start_tp_client(cfg, model_path, **kwargs):
    """LLMClient.create for a tensor-parallel CPU engine, with its workers' thread binding set in
    the environment only while it starts (the in-process engines of later tests must not inherit
    a binding for another number of workers: vLLM asserts they match)."""
    from pipeline_rl.engine.llm_client import LLMClient, cpu_thread_binds

    binding = cpu_thread_binds(cfg.actor.llm.tensor_parallel_size, sorted(os.sched_getaffinity(0)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", binding)
        return LLMClient.create(cfg, str(model_path), **kwargs)
