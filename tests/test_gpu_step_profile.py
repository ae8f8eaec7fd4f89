"""``ops.bench.gpu_step --parts profile`` sorts a GPU step's kernel time by kind from kernel names:
cuDNN's convolutions are implicit GEMMs and must not count as GEMMs, layer norms are "vectorized"
kernels and must not count as elementwise, CUTLASS attention must not count as a GEMM."""

from __future__ import annotations

import pytest

from ops.bench.gpu_step import KERNEL_CLASSES, kernel_class


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_cublas", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, float>", "copy, layout"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::BFloat16, float>", "norm, reduction"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "norm, reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>>", "copy, layout"),
    ("triton_poi_fused_add_mul_silu_0", "elementwise"),
    ("triton_red_fused_native_group_norm_1", "norm, reduction"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("some_unknown_kernel", "other"),
])
def test_kernels_are_sorted_by_kind_from_their_names(name: str, kind: str) -> None:
    assert kind in KERNEL_CLASSES
    assert kernel_class(name) == kind
