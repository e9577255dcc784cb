// CPU kernels for the two memory-bound passes of the gradient filter.
//
// Both passes touch every element of a full-size NCHW tensor exactly once
// (pooling reads it, spreading writes it); everything else in the backward
// works on the 1/r^2-sized patch grid. aten's avg_pool2d walks each output
// window with scalar code, and the pure-PyTorch spread needs two expanding
// copies; these loops stream whole rows instead: rows of a patch are added
// into a one-row buffer (a contiguous, vectorisable add), then the buffer
// is reduced per patch; the spread writes one expanded row and copies it to
// the patch's other rows. The pure-PyTorch path in gradient_filter.py stays
// the reference and the fallback (other dtypes, layouts, devices).
//
// Geometry (one axis; see AxisGeometry in gradient_filter.py): patch P
// covers pixels [start + P*size, start + (P+1)*size) of the map, clipped to
// [0, extent). `start` may be negative (padding) and the last patch may run
// past the map: missing pixels count as zeros.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct Axis {
  int64_t extent;  // pixels in the map
  int64_t start;   // first pixel of patch 0 (may be < 0)
  int64_t size;    // pixels per patch
  int64_t count;   // number of patches

  // First and one-past-last pixel of patch p inside the map (lo <= hi).
  int64_t clip(int64_t v) const {
    return std::min<int64_t>(std::max<int64_t>(v, 0), extent);
  }
  int64_t lo(int64_t p) const { return clip(start + p * size); }
  int64_t hi(int64_t p) const { return clip(start + (p + 1) * size); }
};

Axis make_axis(int64_t extent, int64_t start, int64_t size, int64_t count) {
  TORCH_CHECK(size >= 1 && count >= 1, "patch size and count must be >= 1");
  return Axis{extent, start, size, count};
}

// The patches of an axis that lie wholly inside the map: [first, last).
// Only they take the fixed-size fast loops below; the (at most two) border
// patches take the general clipped loop.
std::pair<int64_t, int64_t> whole_patches(const Axis& a) {
  const int64_t first = std::max<int64_t>(0, (-a.start + a.size - 1) / a.size);
  const int64_t last = std::min<int64_t>(
      a.count, a.start + a.size * a.count <= a.extent
                   ? a.count
                   : (a.extent - a.start) / a.size);
  return {std::min(first, last), last};  // empty range if none is whole
}

// Calls visit(q, size) for every patch q of the axis. `size` is a
// std::integral_constant: the patch size S for whole patches when it is one
// of the common r*s = 2, 4, 8 (known at compile time, so the inner loops
// unroll and vectorise), else 0, meaning "use a.lo(q) .. a.hi(q)".
template <typename Visit>
void for_each_patch(const Axis& a, Visit&& visit) {
  const auto whole = whole_patches(a);
  const std::integral_constant<int, 0> general{};
  for (int64_t q = 0; q < whole.first; ++q) visit(q, general);
  auto run = [&](auto size) {
    for (int64_t q = whole.first; q < whole.second; ++q) visit(q, size);
  };
  switch (a.size) {
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    default: run(general);
  }
  for (int64_t q = whole.second; q < a.count; ++q) visit(q, general);
}

// out[q] = sum of row over patch q.
template <typename acc_t>
void reduce_row(const acc_t* __restrict__ row, acc_t* __restrict__ out,
                const Axis& a) {
  for_each_patch(a, [&](int64_t q, auto size) {
    constexpr int S = decltype(size)::value;
    acc_t sum = 0;
    if constexpr (S > 0) {
      const acc_t* cell = row + a.start + q * S;
      for (int j = 0; j < S; ++j) sum += cell[j];
    } else {
      for (int64_t w = a.lo(q); w < a.hi(q); ++w) sum += row[w];
    }
    out[q] = sum;
  });
}

// line[w] = cells[patch of w], 0 outside every patch.
template <typename scalar_t>
void expand_row(const scalar_t* __restrict__ cells,
                scalar_t* __restrict__ line, const Axis& a) {
  std::fill(line, line + a.lo(0), scalar_t(0));
  for_each_patch(a, [&](int64_t q, auto size) {
    constexpr int S = decltype(size)::value;
    if constexpr (S > 0) {
      scalar_t* cell = line + a.start + q * S;
      for (int j = 0; j < S; ++j) cell[j] = cells[q];
    } else {
      std::fill(line + a.lo(q), line + a.hi(q), cells[q]);
    }
  });
  std::fill(line + a.hi(a.count - 1), line + a.extent, scalar_t(0));
}

// out[n, c, P, Q] = sum of t over patch (P, Q); accumulates in `acc_t`.
template <typename scalar_t, typename acc_t>
void patch_sums_kernel(const scalar_t* src, acc_t* dst, int64_t planes,
                       const Axis& ah, const Axis& aw) {
  const int64_t H = ah.extent, W = aw.extent;
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buffer(static_cast<size_t>(W));
    acc_t* __restrict__ row = buffer.data();
    for (int64_t plane = begin; plane < end; ++plane) {
      const scalar_t* in = src + plane * H * W;
      acc_t* out = dst + plane * ah.count * aw.count;
      for (int64_t p = 0; p < ah.count; ++p) {
        std::fill(row, row + W, acc_t(0));
        for (int64_t h = ah.lo(p); h < ah.hi(p); ++h) {
          const scalar_t* __restrict__ line = in + h * W;
          for (int64_t w = 0; w < W; ++w) row[w] += static_cast<acc_t>(line[w]);
        }
        reduce_row(row, out + p * aw.count, aw);
      }
    }
  });
}

// out[n, c, h, w] = grid[n, c, P(h), Q(w)], 0 outside every patch.
template <typename scalar_t>
void spread_kernel(const scalar_t* src, scalar_t* dst, int64_t planes,
                   const Axis& ah, const Axis& aw) {
  const int64_t H = ah.extent, W = aw.extent;
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) {
      const scalar_t* grid = src + plane * ah.count * aw.count;
      scalar_t* out = dst + plane * H * W;
      int64_t filled = 0;  // rows written so far, top to bottom
      for (int64_t p = 0; p < ah.count; ++p) {
        const int64_t h0 = ah.lo(p), h1 = ah.hi(p);
        if (h0 >= h1) continue;
        std::memset(out + filled * W, 0, sizeof(scalar_t) * (h0 - filled) * W);
        scalar_t* first = out + h0 * W;
        expand_row(grid + p * aw.count, first, aw);
        for (int64_t h = h0 + 1; h < h1; ++h) {
          std::memcpy(out + h * W, first, sizeof(scalar_t) * W);
        }
        filled = h1;
      }
      std::memset(out + filled * W, 0, sizeof(scalar_t) * (H - filled) * W);
    }
  });
}

void check_input(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be N x C x H x W");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (NCHW)");
}

}  // namespace

// Patch sums of a contiguous NCHW tensor; float32 accumulation for float32
// input, float64 for float64.
torch::Tensor patch_sums(const torch::Tensor& input, int64_t start_h,
                         int64_t size_h, int64_t count_h, int64_t start_w,
                         int64_t size_w, int64_t count_w) {
  check_input(input, "input");
  const Axis ah = make_axis(input.size(2), start_h, size_h, count_h);
  const Axis aw = make_axis(input.size(3), start_w, size_w, count_w);
  auto out = torch::empty({input.size(0), input.size(1), count_h, count_w},
                          input.options());
  const int64_t planes = input.size(0) * input.size(1);
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "patch_sums", [&] {
    patch_sums_kernel<scalar_t, scalar_t>(input.data_ptr<scalar_t>(),
                                          out.data_ptr<scalar_t>(), planes, ah,
                                          aw);
  });
  return out;
}

// Broadcast every cell of a contiguous N x C x count_h x count_w grid over
// its patch of an N x C x height x width map.
torch::Tensor spread(const torch::Tensor& grid, int64_t height, int64_t width,
                     int64_t start_h, int64_t size_h, int64_t start_w,
                     int64_t size_w) {  // grid's H, W are the patch counts
  check_input(grid, "grid");
  const Axis ah = make_axis(height, start_h, size_h, grid.size(2));
  const Axis aw = make_axis(width, start_w, size_w, grid.size(3));
  auto out = torch::empty({grid.size(0), grid.size(1), height, width},
                          grid.options());
  const int64_t planes = grid.size(0) * grid.size(1);
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "spread", [&] {
    spread_kernel<scalar_t>(grid.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), planes, ah, aw);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("patch_sums", &patch_sums, "sums over patches of an NCHW tensor");
  m.def("spread", &spread, "broadcast a patch grid over an NCHW map");
}
