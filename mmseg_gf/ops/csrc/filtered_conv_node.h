// The gradient-filtered conv of the usual case as a C++ autograd node: no
// Python runs in its backward (see filtered_conv_node.cpp).

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace mmseg_gf {

// F.conv2d(input, weight, bias, ...) whose backward is the fused gradient
// filter (collapsed_backward), for a contiguous NCHW CPU input of a kernel
// that collapses on both axes (the caller checks the geometry). The input
// patches Q(P) are given by their start and size per axis.
torch::Tensor filtered_conv2d(const torch::Tensor& input,
                              const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias,
                              std::vector<int64_t> stride,
                              std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups,
                              int64_t radius, int64_t start_h, int64_t size_h,
                              int64_t start_w, int64_t size_w);

}  // namespace mmseg_gf
