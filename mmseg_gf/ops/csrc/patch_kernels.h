// Patch kernels: the two passes of the gradient filter over full-size NCHW
// tensors. Pooling sums (or averages) every patch of a map into one cell of
// a patch grid; spreading broadcasts every cell of a grid back over its
// patch. Everything else in the backward works on the 1/r^2-sized grid
// (docs/gradient_filter.md#backward).
//
// Geometry (one axis; see AxisGeometry in gradient_filter.py): patch P
// covers pixels [start + P*size, start + (P+1)*size) of the map, clipped to
// [0, extent). `start` may be negative (padding) and the last patch may run
// past the map: missing pixels count as zeros.

#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>

namespace mmseg_gf {

struct Axis {
  int64_t extent;  // pixels in the map
  int64_t start;   // first pixel of patch 0 (may be < 0)
  int64_t size;    // pixels per patch
  int64_t count;   // number of patches
  // The patches that lie wholly inside the map: [first_whole, last_whole).
  // Only they take the fixed-size fast loops; the (at most two) border
  // patches take the general clipped loop. Computed once (see make_axis):
  // the kernels visit them for every row of every plane.
  int64_t first_whole;
  int64_t last_whole;

  // First and one-past-last pixel of patch p inside the map (lo <= hi).
  int64_t clip(int64_t v) const {
    return std::min<int64_t>(std::max<int64_t>(v, 0), extent);
  }
  int64_t lo(int64_t p) const { return clip(start + p * size); }
  int64_t hi(int64_t p) const { return clip(start + (p + 1) * size); }
};

// The largest patch size r (mmseg_gf/ops/patch_grid.py MAX_RADIUS): every
// index computed from it (H + r - 1, r * stride) stays far inside int64.
constexpr int64_t kMaxRadius = int64_t(1) << 16;

inline void check_radius(int64_t radius) {
  TORCH_CHECK(radius >= 1 && radius <= kMaxRadius, "radius must be in [1, ",
              kMaxRadius, "], got ", radius);
}

// Refuses geometries whose arithmetic could overflow, and keeps every
// visited patch index in [0, count) whatever `start` is (a patch grid that
// starts past the map visits its patches as clipped border patches).
inline Axis make_axis(int64_t extent, int64_t start, int64_t size,
                      int64_t count) {
  TORCH_CHECK(size >= 1 && count >= 1,
              "patch size and count must be >= 1, got size ", size,
              " and count ", count);
  TORCH_CHECK(extent >= 0, "map extent must be >= 0, got ", extent);
  constexpr int64_t kLimit = int64_t(1) << 40;
  TORCH_CHECK(size <= kLimit && count <= kLimit && extent <= kLimit &&
                  start >= -kLimit && start <= kLimit,
              "patch geometry out of range: extent ", extent, ", start ",
              start, ", size ", size, ", count ", count);
  const int64_t first = std::max<int64_t>(0, (-start + size - 1) / size);
  const int64_t last = std::max<int64_t>(
      0, std::min<int64_t>(count, start + size * count <= extent
                                      ? count
                                      : (extent - start) / size));
  return Axis{extent, start, size, count, std::min(first, last), last};
}

// Where the planes of a patch grid lie in memory: plane (n, c) starts at
// n * stride_n + c * stride_c. NCHW grids have stride_n = C * cells and
// stride_c = cells; the fused backward keeps its grids channel-major
// ("CNHW": stride_c = N * cells, stride_n = cells) so that each group's
// grid is one contiguous matrix for the GEMMs, with no permuting copy.
struct GridLayout {
  int64_t channels;
  int64_t stride_n;
  int64_t stride_c;

  int64_t offset(int64_t plane) const {
    return (plane / channels) * stride_n + (plane % channels) * stride_c;
  }
};

inline GridLayout nchw_layout(int64_t channels, int64_t cells) {
  return GridLayout{channels, channels * cells, cells};
}

inline GridLayout cnhw_layout(int64_t batch, int64_t channels,
                              int64_t cells) {
  return GridLayout{channels, cells, batch * cells};
}

// Refuses what the kernels cannot read: a non-CPU, non-4-D, non-contiguous
// or non-float32/float64 tensor, or one with an empty map (H or W of 0).
void check_input(const torch::Tensor& t, const char* name);

// dst (laid out as `layout`) = sums of src over its patches; one plane per
// (n, c) of the contiguous NCHW src. Accumulates in src's dtype.
void sum_patches_into(const torch::Tensor& src, const torch::Tensor& dst,
                      const Axis& ah, const Axis& aw,
                      const GridLayout& layout);

// The gradient filter: dst = scale * mean of src over every patch, partial
// patches averaged over their valid pixels. If `plane_totals` is defined
// (one element per plane), it also receives every plane's total, which is
// the bias gradient, from the same pass.
void average_patches_into(const torch::Tensor& src, const torch::Tensor& dst,
                          const Axis& ah, const Axis& aw,
                          const GridLayout& layout, double scale,
                          const torch::Tensor& plane_totals);

// dst[n, c, h, w] = grid[n, c, P(h), Q(w)] (grid laid out as `layout`), 0
// outside every patch; dst is a contiguous NCHW map written in full.
void spread_into(const torch::Tensor& grid, const torch::Tensor& dst,
                 const Axis& ah, const Axis& aw, const GridLayout& layout);

// Patch sums of a contiguous NCHW tensor; float32 accumulation for float32
// input, float64 for float64. With `channel_major` the result is still
// indexed N x C x count_h x count_w but its memory is C x N x count_h x
// count_w, the layout the fused backward multiplies without copying.
torch::Tensor patch_sums(const torch::Tensor& input, int64_t start_h,
                         int64_t size_h, int64_t count_h, int64_t start_w,
                         int64_t size_w, int64_t count_w, bool channel_major);

// Broadcast every cell of a contiguous N x C x count_h x count_w grid over
// its patch of an N x C x height x width map.
torch::Tensor spread(const torch::Tensor& grid, int64_t height, int64_t width,
                     int64_t start_h, int64_t size_h, int64_t start_w,
                     int64_t size_w);

}  // namespace mmseg_gf
