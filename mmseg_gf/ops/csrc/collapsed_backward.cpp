// The fused backward (see collapsed_backward.h).
//
// The Python path does the same in ~15 ATen calls (pool, means, permuting
// copies, GEMMs, spread); on small layers their fixed costs, not the
// arithmetic, set the time. Here g_y is pooled once into a channel-major
// grid of means (and the bias gradient from the same pass), each GEMM reads
// its operands where they lie, and g_x is spread straight from the
// channel-major product.

#include "collapsed_backward.h"

#include <atomic>

#include "cpu_dispatch.h"
#include "output_recycler.h"
#include "patch_kernels.h"

namespace mmseg_gf {
namespace {

std::atomic<int64_t>& call_counter() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

}  // namespace

int64_t fused_backward_calls() { return call_counter().load(); }

std::vector<torch::Tensor> collapsed_backward(
    const torch::Tensor& grad_output,
    const c10::optional<torch::Tensor>& input_pooled,
    const torch::Tensor& weight, int64_t groups, double scale,
    int64_t in_height, int64_t in_width, int64_t in_start_h, int64_t in_size_h,
    int64_t in_start_w, int64_t in_size_w, int64_t radius, bool need_input,
    bool need_weight, bool need_bias) {
  check_input(grad_output, "grad_output");
  TORCH_CHECK(grad_output.numel() > 0, "grad_output must not be empty, got ",
              grad_output.sizes());
  TORCH_CHECK(weight.defined() && weight.device().is_cpu() &&
                  weight.dim() == 4 && weight.numel() > 0,
              "weight must be a non-empty Co x Ci/groups x kh x kw CPU "
              "tensor");
  TORCH_CHECK(weight.scalar_type() == grad_output.scalar_type(),
              "weight and grad_output must have the same dtype");
  TORCH_CHECK(groups >= 1, "groups must be >= 1, got ", groups);
  check_radius(radius);
  TORCH_CHECK(in_height >= 1 && in_width >= 1,
              "the input size must be >= 1 x 1, got ", in_height, " x ",
              in_width);
  const int64_t N = grad_output.size(0), Co = grad_output.size(1);
  const int64_t ci_g = weight.size(1), co_g = Co / groups, Ci = ci_g * groups;
  TORCH_CHECK(weight.size(0) == Co && co_g * groups == Co,
              "weight does not match grad_output and groups");
  call_counter().fetch_add(1, std::memory_order_relaxed);
  const int64_t count_h = (grad_output.size(2) + radius - 1) / radius;
  const int64_t count_w = (grad_output.size(3) + radius - 1) / radius;
  const int64_t cells = count_h * count_w;
  const Axis out_h = make_axis(grad_output.size(2), 0, radius, count_h);
  const Axis out_w = make_axis(grad_output.size(3), 0, radius, count_w);

  // Step 1 (Eq. 2): patch means of g_y, channel-major; plane totals -> g_b.
  auto means = empty_for_writing({Co, N * cells}, grad_output.options());
  torch::Tensor totals;
  if (need_bias) totals = torch::empty({N, Co}, grad_output.options());
  average_patches_into(grad_output, means, out_h, out_w,
                       cnhw_layout(N, Co, cells), scale, totals);
  const auto by_group = [&](const torch::Tensor& t, int64_t per_group) {
    return t.view({groups, per_group, N * cells});
  };
  torch::Tensor grad_input, grad_kernel, grad_bias;
  if (need_bias) grad_bias = totals.sum(0);

  if (need_weight) {  // Step 4 (Eq. 5): g_W~ = g~ x~^T per group.
    TORCH_CHECK(input_pooled.has_value() && input_pooled->defined(),
                "the weight gradient needs the pooled input");
    const torch::Tensor& pooled = *input_pooled;
    TORCH_CHECK(pooled.device().is_cpu() && pooled.dim() == 4,
                "pooled input must be an N x Ci x rows x cols CPU tensor");
    TORCH_CHECK(pooled.scalar_type() == grad_output.scalar_type() &&
                    pooled.size(0) == N && pooled.size(1) == Ci &&
                    pooled.size(2) == count_h && pooled.size(3) == count_w,
                "pooled input does not match grad_output");
    const torch::Tensor channel_major =
        pooled.permute({1, 0, 2, 3}).contiguous();
    grad_kernel = grouped_matmul(by_group(means, co_g),
                                 by_group(channel_major, ci_g).transpose(1, 2))
                      .view({Co, ci_g, 1, 1});
  }

  if (need_input) {  // Steps 2 and 3 (Eq. 3): g_x~ = W~^T g~, spread on Q(P).
    const int64_t taps = weight.size(2) * weight.size(3);
    const torch::Tensor kernel =
        at::mv(weight.contiguous().view({Co * ci_g, taps}),
               at::ones({taps}, weight.options()))
            .view({groups, co_g, ci_g});
    const torch::Tensor mixed =
        grouped_matmul(kernel.transpose(1, 2), by_group(means, co_g));
    const Axis in_h = make_axis(in_height, in_start_h, in_size_h, count_h);
    const Axis in_w = make_axis(in_width, in_start_w, in_size_w, count_w);
    grad_input = empty_for_writing({N, Ci, in_height, in_width},
                                   grad_output.options());
    spread_into(mixed, grad_input, in_h, in_w, cnhw_layout(N, Ci, cells));
  }
  return {grad_input, grad_kernel, grad_bias};
}

}  // namespace mmseg_gf
