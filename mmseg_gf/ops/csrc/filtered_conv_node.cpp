// The usual filtered conv as a C++ autograd node (see filtered_conv_node.h).

#include "filtered_conv_node.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <utility>

#include "collapsed_backward.h"
#include "patch_kernels.h"

namespace mmseg_gf {

// How a filtered conv convolves and where its input patches Q(P) lie (what
// the Python wrapper computes with AxisGeometry), kept in the autograd
// context as integers.
struct FilteredConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
  int64_t radius;
  // Input patches Q(P); their count is the patch grid's.
  int64_t start_h, size_h, start_w, size_w;

  std::vector<int64_t> pack() const {
    return {stride[0],   stride[1],   padding[0], padding[1], dilation[0],
            dilation[1], groups,      radius,     start_h,    size_h,
            start_w,     size_w};
  }
  static FilteredConvGeometry unpack(const std::vector<int64_t>& v) {
    TORCH_CHECK(v.size() == 12, "corrupt filtered-conv geometry");
    return {{v[0], v[1]}, {v[2], v[3]}, {v[4], v[5]}, v[6],
            v[7],         v[8],         v[9],         v[10], v[11]};
  }
};

// The gradient-filtered conv of the usual case as a C++ autograd node.
//
// A Python autograd.Function costs every layer's backward the interpreter
// and the engine's bridge to Python: with cold caches, as in training right
// after a vanilla backward, about 150 us of Python around the compiled call
// and 110 us more in the engine, where a C++ node such as torch's own conv
// costs about 65 us; on 14x14 layers that is a tenth of the filtered
// backward. This node runs the same compiled passes (patch_sums forward,
// collapsed_backward backward) with no Python on the way; the Python
// Function serves every other case (gradient_filter.filtered_conv).
class GradientFilteredConv2d
    : public torch::autograd::Function<GradientFilteredConv2d> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& input,
                               const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& bias,
                               const FilteredConvGeometry& geo) {
    torch::Tensor out = at::conv2d(input, weight, bias, geo.stride,
                                   geo.padding, geo.dilation, geo.groups);
    // Never save x: only its patch sums, and only if g_W will be needed.
    torch::Tensor pooled;
    if (ctx->needs_input_grad(1)) {
      pooled = patch_sums(input, geo.start_h, geo.size_h,
                          (out.size(2) + geo.radius - 1) / geo.radius,
                          geo.start_w, geo.size_w,
                          (out.size(3) + geo.radius - 1) / geo.radius,
                          /*channel_major=*/true);
    }
    ctx->save_for_backward({pooled, weight});
    ctx->saved_data["geometry"] = geo.pack();
    ctx->saved_data["input_size"] =
        std::vector<int64_t>{input.size(2), input.size(3)};
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return out;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto geo = FilteredConvGeometry::unpack(
        ctx->saved_data["geometry"].toIntVector());
    const auto input_size = ctx->saved_data["input_size"].toIntVector();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    std::vector<torch::Tensor> result;
    {
      at::NoGradGuard no_grad;
      result = collapsed_backward(
          grads[0].contiguous(), saved[0], saved[1], geo.groups,
          1.0 / static_cast<double>(geo.stride[0] * geo.stride[1]),
          input_size[0], input_size[1], geo.start_h, geo.size_h, geo.start_w,
          geo.size_w, geo.radius, ctx->needs_input_grad(0),
          ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2));
    }
    if (result[1].defined()) result[1] = result[1].expand_as(saved[1]);
    torch::autograd::variable_list out{result[0], result[1], result[2],
                                       torch::Tensor()};
    if (!torch::GradMode::is_enabled()) return out;
    // create_graph: as Python's @once_differentiable, these gradients raise
    // when differentiated again rather than give wrong second derivatives.
    for (auto& g : out) {
      if (g.defined()) g = g.detach().requires_grad_(true);
    }
    return torch::autograd::DelayedError(
               "the gradient filter's backward is not differentiable "
               "(double backward through a gradient-filtered conv)",
               static_cast<int64_t>(out.size()))
        .apply(std::move(out));
  }
};

torch::Tensor filtered_conv2d(const torch::Tensor& input,
                              const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias,
                              std::vector<int64_t> stride,
                              std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups,
                              int64_t radius, int64_t start_h, int64_t size_h,
                              int64_t start_w, int64_t size_w) {
  check_input(input, "input");
  TORCH_CHECK(input.numel() > 0, "input must not be empty, got ",
              input.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(weight.defined() && weight.device().is_cpu() &&
                  weight.dim() == 4 && weight.numel() > 0,
              "weight must be a non-empty Co x Ci/groups x kh x kw CPU "
              "tensor");
  TORCH_CHECK(!has_bias || (bias->device().is_cpu() && bias->dim() == 1 &&
                            bias->size(0) == weight.size(0)),
              "bias must be a CPU tensor of Co = ", weight.size(0),
              " elements");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() &&
                  (!has_bias || bias->scalar_type() == input.scalar_type()),
              "input, weight and bias must have the same dtype");
  check_radius(radius);
  TORCH_CHECK(groups >= 1 && input.size(1) == weight.size(1) * groups &&
                  weight.size(0) % groups == 0,
              "groups must be >= 1 and divide the channels: input ",
              input.sizes(), ", weight ", weight.sizes(), ", groups ", groups);
  TORCH_CHECK(
      stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
      "stride, padding and dilation must be pairs");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(stride[i] >= 1 && dilation[i] >= 1 && padding[i] >= 0,
                "stride and dilation must be >= 1 and padding >= 0");
  }
  TORCH_CHECK(size_h >= 1 && size_w >= 1,
              "input patch sizes must be >= 1, got ", size_h, " x ", size_w);
  const bool records =
      torch::GradMode::is_enabled() &&
      (input.requires_grad() || weight.requires_grad() ||
       (has_bias && bias->requires_grad()));
  if (!records) {  // nothing will be differentiated: the plain convolution
    return at::conv2d(input, weight, bias, stride, padding, dilation, groups);
  }
  return GradientFilteredConv2d::apply(
      input, weight, bias,
      FilteredConvGeometry{stride, padding, dilation, groups, radius, start_h,
                           size_h, start_w, size_w});
}

}  // namespace mmseg_gf
