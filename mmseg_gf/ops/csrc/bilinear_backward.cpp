// The backward of a bilinear resize, one axis at a time.
//
// Every output pixel of a bilinear resize mixes two input rows and two
// input columns, with the indices and weights torch's kernel computes
// (mirrored below, in the same precision). So its backward is two sparse
// products: the incoming gradient's rows are added into the input rows
// they came from (whole rows at a time: a contiguous multiply-add that the
// compiler vectorises), then each such row's columns into the input
// columns. torch's own CPU kernel scatters the four terms of every output
// pixel one by one instead; this computes the same sums in another order
// (the result differs by rounding only) and reads a channel slice of a
// batch where it lies.
#include "bilinear_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace mmseg_gf {
namespace {

// One axis: for every output index, its two input indices and weights.
template <typename opmath_t>
struct AxisTaps {
  std::vector<int64_t> first, second;
  std::vector<opmath_t> first_weight, second_weight;

  AxisTaps(int64_t in, int64_t out, bool align_corners, double scale)
      : first(out), second(out), first_weight(out), second_weight(out) {
    // torch's area_pixel_compute_scale
    opmath_t ratio;
    if (align_corners) {
      ratio = out > 1 ? static_cast<opmath_t>(in - 1) / (out - 1)
                      : static_cast<opmath_t>(0);
    } else {
      ratio = scale > 0 ? static_cast<opmath_t>(1.0 / scale)
                        : static_cast<opmath_t>(in) / out;
    }
    for (int64_t o = 0; o < out; ++o) {
      if (in == out) {  // torch copies: weights 1 and 0
        first[o] = second[o] = o;
        first_weight[o] = 1;
        second_weight[o] = 0;
        continue;
      }
      // torch's area_pixel_compute_source_index and guard_index_and_lambda
      opmath_t real = align_corners
                          ? ratio * o
                          : ratio * (o + static_cast<opmath_t>(0.5)) -
                                static_cast<opmath_t>(0.5);
      if (!align_corners && real < 0) real = 0;
      // A scale far from in / out (or NaN) must not overflow the index
      // below; real >= in gives index in - 1 and lambda 1 either way.
      if (!(real <= static_cast<opmath_t>(in))) {
        real = static_cast<opmath_t>(in);
      }
      const int64_t index =
          std::min(static_cast<int64_t>(std::floor(real)), in - 1);
      const opmath_t lambda = std::min(
          std::max(real - static_cast<opmath_t>(index),
                   static_cast<opmath_t>(0)),
          static_cast<opmath_t>(1));
      first[o] = index;
      second[o] = index + (index < in - 1 ? 1 : 0);
      first_weight[o] = static_cast<opmath_t>(1) - lambda;
      second_weight[o] = lambda;
    }
  }
};

template <typename scalar_t>
void planes_backward(const at::Tensor& grad, at::Tensor& out,
                     bool align_corners, double scale_h, double scale_w) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t n = grad.size(0), c = grad.size(1);
  const int64_t ho = grad.size(2), wo = grad.size(3);
  const int64_t hi = out.size(2), wi = out.size(3);
  const AxisTaps<opmath_t> rows(hi, ho, align_corners, scale_h);
  const AxisTaps<opmath_t> cols(wi, wo, align_corners, scale_w);
  const scalar_t* g = grad.data_ptr<scalar_t>();
  scalar_t* result = out.data_ptr<scalar_t>();
  const int64_t image_stride = grad.stride(0);
  at::parallel_for(0, n * c, 1, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> by_row(hi * wo), plane(wi);
    for (int64_t p = begin; p < end; ++p) {
      const scalar_t* src = g + (p / c) * image_stride + (p % c) * ho * wo;
      // 1. rows: by_row[iy] = sum over oy of weight(oy -> iy) * grad[oy]
      std::fill(by_row.begin(), by_row.end(), opmath_t(0));
      for (int64_t oy = 0; oy < ho; ++oy) {
        const scalar_t* line = src + oy * wo;
        opmath_t* a = by_row.data() + rows.first[oy] * wo;
        opmath_t* b = by_row.data() + rows.second[oy] * wo;
        const opmath_t wa = rows.first_weight[oy];
        const opmath_t wb = rows.second_weight[oy];
        for (int64_t x = 0; x < wo; ++x) a[x] += wa * line[x];
        for (int64_t x = 0; x < wo; ++x) b[x] += wb * line[x];
      }
      // 2. columns, row by row, into the result
      scalar_t* dst = result + p * hi * wi;
      for (int64_t iy = 0; iy < hi; ++iy) {
        std::fill(plane.begin(), plane.end(), opmath_t(0));
        const opmath_t* line = by_row.data() + iy * wo;
        for (int64_t ox = 0; ox < wo; ++ox) {
          plane[cols.first[ox]] += cols.first_weight[ox] * line[ox];
          plane[cols.second[ox]] += cols.second_weight[ox] * line[ox];
        }
        for (int64_t x = 0; x < wi; ++x)
          dst[iy * wi + x] = static_cast<scalar_t>(plane[x]);
      }
    }
  });
}

}  // namespace

void bilinear_backward(const at::Tensor& grad, at::Tensor& out,
                       bool align_corners, double scale_h, double scale_w) {
  TORCH_CHECK(grad.device().is_cpu() && out.device().is_cpu(),
              "bilinear_backward: CPU tensors");
  TORCH_CHECK(grad.dim() == 4 && out.dim() == 4 &&
                  grad.size(0) == out.size(0) && grad.size(1) == out.size(1),
              "bilinear_backward: N x C x H x W gradient and result");
  TORCH_CHECK(grad.scalar_type() == out.scalar_type(),
              "bilinear_backward: one dtype");
  TORCH_CHECK(grad.scalar_type() == at::kFloat ||
                  grad.scalar_type() == at::kDouble,
              "bilinear_backward: float32 or float64, got ",
              grad.scalar_type());
  TORCH_CHECK(grad.size(2) > 0 && grad.size(3) > 0 && out.size(2) > 0 &&
                  out.size(3) > 0,
              "bilinear_backward: input and output sizes must be > 0, got "
              "gradient ",
              grad.sizes(), " and result ", out.sizes());
  TORCH_CHECK(out.is_contiguous(), "bilinear_backward: contiguous result");
  const int64_t ho = grad.size(2), wo = grad.size(3);
  TORCH_CHECK(grad.stride(3) == 1 && grad.stride(2) == wo &&
                  grad.stride(1) == ho * wo,
              "bilinear_backward: each image of the gradient contiguous");
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "bilinear_backward", [&] {
    planes_backward<scalar_t>(grad, out, align_corners, scale_h, scale_w);
  });
}

}  // namespace mmseg_gf
