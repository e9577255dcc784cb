// Patch kernels (see patch_kernels.h): pooling and spreading.
//
// Both passes touch every element of an NCHW tensor exactly once (pooling
// reads it, spreading writes it). aten's avg_pool2d walks each output
// window with scalar code, and the pure-PyTorch spread needs two expanding
// copies; these loops stream whole rows instead: rows of a patch are added
// into a one-row buffer (a contiguous, vectorisable add), then the buffer
// is reduced per patch; the spread writes one expanded row and copies it to
// the patch's other rows. The pure-PyTorch path in gradient_filter.py stays
// the reference and the fallback (other dtypes, layouts, devices).

#include "patch_kernels.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "output_recycler.h"

namespace mmseg_gf {
namespace {

// Calls visit(q, size) for every patch q of the axis. `size` is a
// std::integral_constant: the patch size S for whole patches when it is one
// of the common r*s = 2, 4, 8 (known at compile time, so the inner loops
// unroll and vectorise), else 0, meaning "use a.lo(q) .. a.hi(q)".
template <typename Visit>
void for_each_patch(const Axis& a, Visit&& visit) {
  const std::integral_constant<int, 0> general{};
  for (int64_t q = 0; q < a.first_whole; ++q) visit(q, general);
  auto run = [&](auto size) {
    for (int64_t q = a.first_whole; q < a.last_whole; ++q) visit(q, size);
  };
  switch (a.size) {
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    default: run(general);
  }
  for (int64_t q = a.last_whole; q < a.count; ++q) visit(q, general);
}

// out[i] = sum of the i-th run of S values of `runs`, for i < n. A plain
// counted loop with S known at compile time, which the compiler vectorises
// (strided loads and shuffles); a call per patch is not.
template <int S, typename acc_t>
void sum_runs(const acc_t* __restrict__ runs, acc_t* __restrict__ out,
              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t sum = runs[S * i];
    for (int j = 1; j < S; ++j) sum += runs[S * i + j];
    out[i] = sum;
  }
}

// out[q] = sum of row over patch q.
template <typename acc_t>
void reduce_row(const acc_t* __restrict__ row, acc_t* __restrict__ out,
                const Axis& a) {
  auto clipped = [&](int64_t q) {
    acc_t sum = 0;
    for (int64_t w = a.lo(q); w < a.hi(q); ++w) sum += row[w];
    out[q] = sum;
  };
  for (int64_t q = 0; q < a.first_whole; ++q) clipped(q);
  const acc_t* runs = row + a.start + a.first_whole * a.size;
  const int64_t n = a.last_whole - a.first_whole;
  switch (a.size) {
    case 2: sum_runs<2>(runs, out + a.first_whole, n); break;
    case 4: sum_runs<4>(runs, out + a.first_whole, n); break;
    case 8: sum_runs<8>(runs, out + a.first_whole, n); break;
    default:
      for (int64_t q = a.first_whole; q < a.last_whole; ++q) clipped(q);
  }
  for (int64_t q = a.last_whole; q < a.count; ++q) clipped(q);
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

// What to write per patch: plain sums (the forward's pooling of x), or
// means times `scale` (the gradient filter on g_y, partial patches averaged
// over their valid pixels), optionally with every plane's total (the bias
// gradient, from the same pass).
template <typename acc_t>
struct PatchReduction {
  bool average = false;
  acc_t scale = 1;
  acc_t* plane_totals = nullptr;  // one per plane (n, c), if not null
};

// row[w] = line[w] (kFirst) or row[w] += line[w]: one row, one sequential
// stream. Out of line so that the compiler cannot fuse the calls for
// consecutive rows back into one loop over several rows (GCC's -O3
// unroll-and-jam does), which is the access pattern add_rows avoids on
// long rows.
template <bool kFirst, typename scalar_t, typename acc_t>
[[gnu::noinline]] void accumulate_row(const scalar_t* __restrict__ line,
                                      int64_t W, acc_t* __restrict__ row) {
  for (int64_t w = 0; w < W; ++w) {
    if constexpr (kFirst) {
      row[w] = static_cast<acc_t>(line[w]);
    } else {
      row[w] += static_cast<acc_t>(line[w]);
    }
  }
}

// row[w] = sum over the plane's rows [h0, h1) at column w.
//
// Short rows (at most kShortRowBytes) of the usual patch heights are added
// in one pass, one store per column instead of one per row: on small maps,
// which the caches hold, this loop is most of the pooling time. Longer rows
// are read one after the other, because reading two or four rows side by
// side from memory runs at a half to a third of the speed of one sequential
// stream once rows are longer than about a hundred floats (a 78 MB
// 128x120x160 batch, single-threaded: 8.1 vs 3.8 ms), while rows of up to 80
// floats run equally fast either way.
template <typename scalar_t, typename acc_t>
void add_rows(const scalar_t* plane, int64_t W, int64_t h0, int64_t h1,
              acc_t* __restrict__ row) {
  constexpr int64_t kShortRowBytes = 320;
  const bool short_rows =
      W * static_cast<int64_t>(sizeof(scalar_t)) <= kShortRowBytes;
  const scalar_t* __restrict__ a = plane + h0 * W;
  if (short_rows && h1 - h0 == 4) {
    const scalar_t* __restrict__ b = a + W;
    const scalar_t* __restrict__ c = b + W;
    const scalar_t* __restrict__ d = c + W;
    for (int64_t w = 0; w < W; ++w) {
      row[w] = (static_cast<acc_t>(a[w]) + static_cast<acc_t>(b[w])) +
               (static_cast<acc_t>(c[w]) + static_cast<acc_t>(d[w]));
    }
  } else if (short_rows && h1 - h0 == 2) {
    const scalar_t* __restrict__ b = a + W;
    for (int64_t w = 0; w < W; ++w) {
      row[w] = static_cast<acc_t>(a[w]) + static_cast<acc_t>(b[w]);
    }
  } else if (h1 <= h0) {
    std::fill(row, row + W, acc_t(0));
  } else {
    accumulate_row<true>(a, W, row);
    for (int64_t h = h0 + 1; h < h1; ++h) {
      accumulate_row<false>(plane + h * W, W, row);
    }
  }
}

// out[n, c, P, Q] = sum of t over patch (P, Q); accumulates in `acc_t`.
template <typename scalar_t, typename acc_t>
void patch_sums_kernel(const scalar_t* src, acc_t* dst, int64_t planes,
                       const Axis& ah, const Axis& aw,
                       const GridLayout& out_layout,
                       const PatchReduction<acc_t>& how) {
  const int64_t H = ah.extent, W = aw.extent;
  const int64_t cells = ah.count * aw.count;
  // scale / (valid pixels) of every patch, for the means. Output patches
  // start at 0 and number ceil(extent / r): none is empty. Like every
  // per-patch quantity here it is computed once per call, not per plane or
  // row: on small maps (a 14x14 map at r = 4 is 16 patches) such per-row
  // bookkeeping, not the data, would set the time.
  std::vector<acc_t> cell_scales;
  if (how.average) {
    for (int64_t p = 0; p < ah.count; ++p) {
      for (int64_t q = 0; q < aw.count; ++q) {
        cell_scales.push_back(how.scale / static_cast<acc_t>(
            (ah.hi(p) - ah.lo(p)) * (aw.hi(q) - aw.lo(q))));
      }
    }
  }
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buffer(static_cast<size_t>(W));
    acc_t* __restrict__ row = buffer.data();
    for (int64_t plane = begin; plane < end; ++plane) {
      const scalar_t* in = src + plane * H * W;
      acc_t* __restrict__ out = dst + out_layout.offset(plane);
      for (int64_t p = 0; p < ah.count; ++p) {
        add_rows(in, W, ah.lo(p), ah.hi(p), row);
        reduce_row(row, out + p * aw.count, aw);
      }
      if (how.plane_totals) {
        acc_t total = 0;
        for (int64_t i = 0; i < cells; ++i) total += out[i];
        how.plane_totals[plane] = total;
      }
      if (how.average) {
        for (int64_t i = 0; i < cells; ++i) out[i] *= cell_scales[i];
      }
    }
  });
}

// out[n, c, h, w] = grid[n, c, P(h), Q(w)], 0 outside every patch.
template <typename scalar_t>
void spread_kernel(const scalar_t* src, scalar_t* dst, int64_t planes,
                   const Axis& ah, const Axis& aw,
                   const GridLayout& in_layout) {
  const int64_t H = ah.extent, W = aw.extent;
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) {
      const scalar_t* grid = src + in_layout.offset(plane);
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

}  // namespace

void check_input(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be N x C x H x W, got ", t.dim(),
              " dimensions");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              name, " must be float32 or float64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (NCHW)");
  TORCH_CHECK(t.size(2) >= 1 && t.size(3) >= 1, name,
              " must have H, W >= 1, got ", t.sizes());
}

void sum_patches_into(const torch::Tensor& src, const torch::Tensor& dst,
                      const Axis& ah, const Axis& aw,
                      const GridLayout& layout) {
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "patch_sums", [&] {
    patch_sums_kernel<scalar_t, scalar_t>(
        src.data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(),
        src.size(0) * src.size(1), ah, aw, layout, PatchReduction<scalar_t>{});
  });
}

void average_patches_into(const torch::Tensor& src, const torch::Tensor& dst,
                          const Axis& ah, const Axis& aw,
                          const GridLayout& layout, double scale,
                          const torch::Tensor& plane_totals) {
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "filter_grad", [&] {
    PatchReduction<scalar_t> how;
    how.average = true;
    how.scale = static_cast<scalar_t>(scale);
    how.plane_totals =
        plane_totals.defined() ? plane_totals.data_ptr<scalar_t>() : nullptr;
    patch_sums_kernel<scalar_t, scalar_t>(
        src.data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(),
        src.size(0) * src.size(1), ah, aw, layout, how);
  });
}

void spread_into(const torch::Tensor& grid, const torch::Tensor& dst,
                 const Axis& ah, const Axis& aw, const GridLayout& layout) {
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "spread", [&] {
    spread_kernel<scalar_t>(grid.data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(),
                            dst.size(0) * dst.size(1), ah, aw, layout);
  });
}

torch::Tensor patch_sums(const torch::Tensor& input, int64_t start_h,
                         int64_t size_h, int64_t count_h, int64_t start_w,
                         int64_t size_w, int64_t count_w, bool channel_major) {
  check_input(input, "input");
  const Axis ah = make_axis(input.size(2), start_h, size_h, count_h);
  const Axis aw = make_axis(input.size(3), start_w, size_w, count_w);
  const int64_t N = input.size(0), C = input.size(1);
  torch::Tensor out =
      channel_major
          ? empty_for_writing({C, N, count_h, count_w}, input.options())
                .permute({1, 0, 2, 3})
          : empty_for_writing({N, C, count_h, count_w}, input.options());
  const GridLayout layout = channel_major ? cnhw_layout(N, C, count_h * count_w)
                                          : nchw_layout(C, count_h * count_w);
  sum_patches_into(input, out, ah, aw, layout);
  return out;
}

torch::Tensor spread(const torch::Tensor& grid, int64_t height, int64_t width,
                     int64_t start_h, int64_t size_h, int64_t start_w,
                     int64_t size_w) {  // grid's H, W are the patch counts
  check_input(grid, "grid");
  TORCH_CHECK(height >= 1 && width >= 1,
              "spread: height and width must be >= 1, got ", height, " x ",
              width);
  const Axis ah = make_axis(height, start_h, size_h, grid.size(2));
  const Axis aw = make_axis(width, start_w, size_w, grid.size(3));
  auto out = empty_for_writing({grid.size(0), grid.size(1), height, width},
                               grid.options());
  spread_into(grid, out, ah, aw,
              nchw_layout(grid.size(1), grid.size(2) * grid.size(3)));
  return out;
}

}  // namespace mmseg_gf
