// The whole gradient-filter backward of the usual conv in one call: the
// kernel collapses on both axes (every tap of a patch's outputs reads
// inside the patch's input patch), as for every conv but strongly dilated
// ones (docs/gradient_filter.md#dilated-convolutions).

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace mmseg_gf {

// Steps 1-4 of docs/gradient_filter.md#backward for a contiguous NCHW CPU
// g_y. `input_pooled` is the forward's patch sums of x (N x Ci x P x Q,
// ideally channel-major memory); it may be undefined when the weight
// gradient is not needed. `scale` is 1/s^2; the input patches Q(P) are
// given by their start and size per axis. Returns {g_x (N x Ci x H x W),
// g_W on the pooled kernel (Co x Ci/groups x 1 x 1), g_b (Co)}, each
// undefined unless asked for.
std::vector<torch::Tensor> collapsed_backward(
    const torch::Tensor& grad_output,
    const c10::optional<torch::Tensor>& input_pooled,
    const torch::Tensor& weight, int64_t groups, double scale,
    int64_t in_height, int64_t in_width, int64_t in_start_h, int64_t in_size_h,
    int64_t in_start_w, int64_t in_size_w, int64_t radius, bool need_input,
    bool need_weight, bool need_bias);

// How many times collapsed_backward has run in this process, from either
// autograd path (a diagnostic for the tests).
int64_t fused_backward_calls();

}  // namespace mmseg_gf
