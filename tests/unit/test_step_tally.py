"""scripts/step_tally.py, which counts what a step asks of a device (gpu_check.py --tally): each
operator's FLOPs and the bytes it reads and writes, priced at a peak and a bandwidth, and the
extrapolation of the counts to the full shape."""

import pytest
import torch
from fixtures.helpers import load_script

PEAK, BANDWIDTH = 1e12, 1e9  # FLOP/s, bytes/s: round numbers to price by


@pytest.fixture(scope="module")
def step_tally():
    return load_script("step_tally")


def test_a_matrix_product_counts_its_flops_and_its_three_matrices(step_tally):
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    with step_tally.StepTally(PEAK, BANDWIDTH) as tally:
        a @ b
    mm = tally.summary()["matmul"]
    assert mm["ops"] == 1 and mm["flops"] == 2 * 64 * 32 * 16
    assert mm["bytes"] == 2 * (64 * 32 + 32 * 16 + 64 * 16)


def test_bytes_count_reads_and_writes_once_and_views_nothing(step_tally):
    x, y = torch.randn(100), torch.randn(100)
    with step_tally.StepTally(PEAK, BANDWIDTH) as tally:
        x.add_(y)  # reads x and y, writes x
        x.t().reshape(10, 10)[2:]  # views: nothing moved
        x.copy_(y)  # reads y, writes x
        x.zero_()  # writes x
        torch.empty(1000)  # an allocation: nothing moved
        x.mul(x)  # reads x once, writes the product
    tensor = 100 * 4
    counted = tally.summary()
    assert sum(k["ops"] for k in counted.values()) == 4
    assert sum(k["bytes"] for k in counted.values()) == (3 + 2 + 1 + 2) * tensor
    assert all(k["flops"] == 0 for k in counted.values())


def test_a_compiled_function_counts_as_one_operator_over_its_inputs_and_outputs(step_tally):
    def softmax_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(z.float() * 2, -1)
        return lse, (z.float() * 2 - lse[:, None]).exp().sum(-1)

    compiled = torch.compile(softmax_stats, dynamic=True)
    z = torch.randn(16, 50)
    with step_tally.StepTally(PEAK, BANDWIDTH) as tally:
        fused = tally.fused(compiled)
        lse, total = fused(z)
    assert tally.summary() == {"compiled": {"ops": 1, "flops": 0.0, "bytes": (16 * 50 + 16 + 16) * 4.0}}
    torch.testing.assert_close(total, torch.ones(16))  # it ran, and gave the function's values
    torch.testing.assert_close(lse, torch.logsumexp(z * 2, -1))


def test_each_operator_is_priced_by_its_flops_or_its_bytes_whichever_takes_longer(step_tally):
    """A [256, 256] x [256, 256] float32 product of two matrices (a matrix used twice is read
        once): 33.6 MFLOP (33.6 us at the peak), 786 KB (786
        us at the bandwidth): bytes bound. Then two elementwise operators on 1,000 floats, each reading
    and writing 4 KB."""
    a, b, v = torch.randn(256, 256), torch.randn(256, 256), torch.randn(1000)
    with step_tally.StepTally(PEAK, BANDWIDTH) as tally:
        a @ b
        v + v
        v.neg()
    least = tally.least_seconds()
    assert least["matmul"] == pytest.approx(3 * 256 * 256 * 4 / BANDWIDTH)
    assert least["elementwise"] == pytest.approx((2 + 2) * 1000 * 4 / BANDWIDTH)
    fast_memory = step_tally.StepTally(PEAK, 1e15)  # now the product's FLOPs take longer
    with fast_memory:
        a @ b
    assert fast_memory.least_seconds()["matmul"] == pytest.approx(2 * 256**3 / PEAK)


def test_the_extrapolation_is_exact_for_counts_bilinear_in_layers_and_tokens(step_tally):
    def count(layers: int, tokens: int) -> float:
        return 5.0 + 3.0 * layers + 0.25 * tokens + 0.125 * layers * tokens

    points = {p: count(*p) for p in step_tally.POINTS}
    assert step_tally.bilinear(points, 24, 8192) == count(24, 8192)
    assert step_tally.bilinear(points, 1, 1024) == count(1, 1024)


def test_a_compiled_function_counts_only_while_the_tally_is_entered(step_tally):
    tally = step_tally.StepTally(PEAK, BANDWIDTH)
    double = tally.fused(torch.compile(lambda x: x * 2, dynamic=True))
    x = torch.randn(8)
    torch.testing.assert_close(double(x), x * 2)  # before: not counted
    with tally:
        double(x)
    double(x)  # after: not counted
    assert tally.summary()["compiled"]["ops"] == 1


def test_an_optimizer_step_counts_the_state_it_writes_in_place(step_tally):
    """torch's fused AdamW returns nothing: what it writes is in its schema. Per float32
    parameter it reads the weight, its gradient and the two moments and writes the weight and
    the moments: 28 bytes."""
    weight = torch.nn.Parameter(torch.randn(1000))
    weight.grad = torch.randn(1000)
    opt = torch.optim.AdamW([weight], fused=True)
    opt.step()  # makes the moments
    with step_tally.StepTally(PEAK, BANDWIDTH) as tally:
        opt.step()
    counted = tally.summary()["optimizer"]
    # And the step count (one float32): incremented (read, written) by a foreach add, then read.
    assert counted["ops"] == 2 and counted["bytes"] == 28 * 1000 + 3 * 4
