"""The Ray placement group built from the plan (pipeline_rl/launch/bundles.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fixtures.helpers import ROOT

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.launch.bundles import bundles, describe_bundles
from pipeline_rl.launch.placement import plan


@pytest.mark.parametrize("name", ["math_7b", "math_32b"])
def test_one_bundle_per_process_with_its_gpus_on_one_node(name):
    cfg = load_config(name)
    specs = plan(cfg)
    found = bundles(cfg, specs)
    assert [b.spec.name for b in found] == [s.name for s in specs]
    assert found[0].spec.name == "trainer0"
    tp = cfg.shared.tensor_parallel_size
    for b in found:
        want = {"trainer": 1, "actor": tp, "preprocessor": cfg.world.preprocessor_gpus}[b.spec.pool]
        assert b.resources.get("GPU", 0) == want and b.resources["CPU"] == 1
    assert sum(b.resources.get("GPU", 0) for b in found) <= cfg.world.nodes * cfg.world.gpus_per_node


def test_cpu_bundles_and_their_description():
    cfg = load_config(
        "tiny", ["world.nodes=3", "streams.backend=redis", "streams.redis.start_server=true", "world.actors=2"]
    )
    found = bundles(cfg, plan(cfg))
    assert [b.resources for b in found] == [{"CPU": 1.0}] * 4
    lines = describe_bundles(cfg, found)
    assert lines[0].startswith("Ray placement group (PACK, 4 bundles, CPU 4; world.nodes=3)")
    assert "trainer0" in lines[1] and "plan node 0" in lines[1] and lines[1].endswith("+ redis-server")
    assert "actor1" in lines[4] and "plan node 1" in lines[4] and "{CPU: 1}" in lines[4]


def test_one_node_needs_no_ray():
    """The launcher, a one-node dry run and a pool process's entry import nothing of Ray."""
    code = (
        "import sys; from pipeline_rl.launch.launcher import main; import pipeline_rl.core.process; "
        "assert main(['conf=tiny', '--dry-run']) == 0; "
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120, capture_output=True)


def test_a_run_on_ray_needs_redis_streams():
    """On Ray the processes may land on several nodes, where JSONL files cannot carry the streams."""
    with pytest.raises(ConfigError, match=r"'streams.backend' must be redis when 'world.ray_address' is set"):
        load_config("tiny", ["world.ray_address=10.0.0.1:6379"])
    with pytest.raises(ConfigError, match=r"'streams.backend' must be redis when 'world.nodes' > 1"):
        load_config("tiny", ["world.nodes=2"])
    assert load_config("tiny", ["world.ray_address=10.0.0.1:6379", "streams.backend=redis"]).world.ray_address
