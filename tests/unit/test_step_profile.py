"""scripts/step_profile.py, which sums a profile of a loop's steps by kind (gpu_check.py --profile):
kernels sorted into kinds by name, and the device's busy share as the union of kernel intervals."""

import pytest
from fixtures.helpers import load_script


@pytest.fixture(scope="module")
def step_profile():
    return load_script("step_profile")


# Kernel names as CUDA profiles of the trainer and the bare loop show them, and CPU operators.
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "matmul",
    "aten::addmm": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda(at::TensorIteratorBase&)>": "copy",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": "softmax",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper<float>>>": "norm and reduction",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "aten::mul": "elementwise",
}


def test_kernels_fall_into_their_kinds(step_profile):
    assert {name: step_profile.kind_of(name) for name in NAMES} == NAMES


def test_time_by_kind_sums_names_and_kinds(step_profile):
    items = [("aten::mm", 3e6), ("aten::mm", 1e6), ("aten::_softmax", 2e6), ("aten::mul", 4e6), ("sdpa_fwd", 2e6)]
    summary = step_profile.time_by_kind(items)
    assert summary["kernel_s"] == 12
    assert summary["by_kind_s"] == {"matmul": 4, "elementwise": 4, "softmax": 2, "attention": 2}
    assert summary["attention_share"] == round(2 / 12, 3)
    assert summary["top_kernels"][0] == ("aten::mm", 4)


def test_busy_share_counts_overlapping_kernels_once(step_profile):
    # Two streams: [0, 10) and [5, 20) overlap in [5, 10); [30, 40) alone; [32, 35) inside it.
    intervals = [(30, 40), (0, 10), (5, 20), (32, 35)]
    assert step_profile.busy_share(intervals, 100) == 0.3
    assert step_profile.busy_share([], 100) == 0
    assert step_profile.busy_share(intervals, 0) is None
