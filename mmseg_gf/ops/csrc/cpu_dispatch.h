// CPU dispatch of the fused backward's two products: MKL's batched GEMM, or
// oneDNN's 1x1 convolution on CPUs where that runs faster. See
// cpu_dispatch.cpp for the rule and the reason.

#pragma once

#include <torch/types.h>

namespace mmseg_gf {

// Whether this is an AMD CPU that executes AVX-512 at full width (Zen 5,
// family 1Ah, and later): the CPUs where large float32 products take the
// oneDNN route by default.
bool amd_cpu_with_full_width_avx512();

// Lets large float32 products take the oneDNN route (true) or keeps them on
// MKL (false); returns the previous setting.
bool set_onednn_products(bool enabled);

// The current setting: whether float32 products may leave MKL for AVX-512
// code (oneDNN here, or the token-grid kernel's own weight-gradient
// product, token_rows_avx512.h).
bool onednn_products_enabled();

// out[g] = a[g] b[g] per group, for groups x M x K and groups x K x S
// operands of any strides; out is groups x M x S, contiguous.
torch::Tensor grouped_matmul(const torch::Tensor& a, const torch::Tensor& b);

// a b for a contiguous n x K float matrix a and a K x N matrix b whose
// transpose `b_t` (N x K, contiguous) is given too: a contiguous n x N
// tensor. Where large float32 products may take the oneDNN route and the
// product has at least kOneDnnMinRowMacs multiply-adds, it runs on oneDNN's
// inner product (torch's mkldnn::_linear_pointwise, b_t as its weight),
// else on MKL's GEMM (into `out` where given: n x N, contiguous).
torch::Tensor rows_times_matrix(const torch::Tensor& a, const torch::Tensor& b,
                                const torch::Tensor& b_t,
                                const torch::Tensor& out);

}  // namespace mmseg_gf
