// The gradient filter of a Linear on a token grid (see
// token_grid_backward.h).
//
// The pure-PyTorch path (gradient_filter_linear.py, the reference and the
// fallback) pools g_y with a channels-last avg_pool2d, which costs about two
// reads of g_y, and spreads g_x with broadcasting copies. Here every token
// is a contiguous C-vector: a patch row of tokens is added into one row of
// patch cells (Pw x C, in L1/L2) while g_y streams by once, and the spread
// copies each patch's C-vector of g_x~ to its tokens, one write of g_x. The
// two GEMMs run chunk by chunk of patch rows, so that the means and g_x~
// they read and write stay in cache between the passes.

#include "token_grid_backward.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_dispatch.h"
#include "output_recycler.h"
#include "patch_kernels.h"
#include "token_rows_avx512.h"

namespace mmseg_gf {
namespace {

// The patch grid of an H x W token grid at radius r.
struct Geometry {
  int64_t L, H, W, r, Ph, Pw;

  int64_t rows_of(int64_t P) const { return std::min(r, H - P * r); }
  int64_t cols_of(int64_t q) const { return std::min(r, W - q * r); }
};

// Element strides of an L x H x W x C tensor of token rows (C: stride 1).
struct RowStrides {
  int64_t l, h, w;

  static RowStrides of(const torch::Tensor& t) {
    return RowStrides{t.stride(0), t.stride(1), t.stride(2)};
  }
  int64_t token(int64_t l_, int64_t h_, int64_t w_) const {
    return l_ * l + h_ * h + w_ * w;
  }
};

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be L x H x W x C token rows, got ",
              t.dim(), " dims");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              name, " must be float32 or float64, got ", t.scalar_type());
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, name,
              " must have channel (last axis) stride 1, got ", t.stride(3));
}

Geometry geometry_of(const torch::Tensor& rows, int64_t radius) {
  check_radius(radius);
  const int64_t H = rows.size(1), W = rows.size(2);
  return Geometry{rows.size(0), H, W, radius, (H + radius - 1) / radius,
                  (W + radius - 1) / radius};
}

// The two full-size passes are compiled for three instruction sets (the
// extension is built for baseline x86-64, whose 16-byte vectors make the
// pooling cost about two reads of g_y) and picked at load time by the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MMSEG_GF_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MMSEG_GF_VECTOR_CLONES
#endif

// cell (+)= the sum of n tokens `sw` elements apart: N = n known at compile
// time (whole patches of r = 2, 4, 8: the sum stays in registers, one
// store per channel), else N = 0 (one pass per token).
template <int N, bool kFirst, typename scalar_t>
inline void add_tokens(scalar_t* __restrict__ cell,
                       const scalar_t* __restrict__ t, int64_t sw, int64_t C,
                       int64_t n) {
  if constexpr (N > 0) {
    for (int64_t c = 0; c < C; ++c) {
      scalar_t acc = kFirst ? t[c] : cell[c] + t[c];
      for (int j = 1; j < N; ++j) acc += t[j * sw + c];
      cell[c] = acc;
    }
  } else {
    for (int64_t c = 0; c < C; ++c) cell[c] = kFirst ? t[c] : cell[c] + t[c];
    for (int64_t j = 1; j < n; ++j) {
      for (int64_t c = 0; c < C; ++c) cell[c] += t[j * sw + c];
    }
  }
}

// The cells of one token row h (patch row P's first: kFirst) of a patch
// row: whole patches of N tokens, then the partial last one.
template <int N, bool kFirst, typename scalar_t>
inline void add_token_row(scalar_t* __restrict__ out,
                          const scalar_t* __restrict__ row, int64_t sw,
                          const Geometry& g, int64_t C) {
  const int64_t whole = g.W / g.r;
  for (int64_t q = 0; q < whole; ++q) {
    add_tokens<N, kFirst>(out + q * C, row + q * g.r * sw, sw, C, g.r);
  }
  if (whole < g.Pw) {
    add_tokens<0, kFirst>(out + whole * C, row + whole * g.r * sw, sw, C,
                          g.W - whole * g.r);
  }
}

template <int N, typename scalar_t>
inline void pool_rows_of(const scalar_t* src, const RowStrides& s,
                         const Geometry& g, int64_t C, int64_t l, int64_t P,
                         scalar_t* __restrict__ out) {
  const int64_t h0 = P * g.r, h1 = h0 + g.rows_of(P);
  add_token_row<N, true>(out, src + s.token(l, h0, 0), s.w, g, C);
  for (int64_t h = h0 + 1; h < h1; ++h) {
    add_token_row<N, false>(out, src + s.token(l, h, 0), s.w, g, C);
  }
}

// out (Pw x C, contiguous) = sums of patch row P of image l over every
// patch: the patch's token rows are read one after the other (one
// sequential stream per token row), each token added into its cell.
template <typename scalar_t>
MMSEG_GF_VECTOR_CLONES void pool_patch_row(const scalar_t* src,
                                           const RowStrides& s,
                                           const Geometry& g, int64_t C,
                                           int64_t l, int64_t P,
                                           scalar_t* __restrict__ out) {
  switch (g.r) {
    case 2: pool_rows_of<2>(src, s, g, C, l, P, out); break;
    case 4: pool_rows_of<4>(src, s, g, C, l, P, out); break;
    case 8: pool_rows_of<8>(src, s, g, C, l, P, out); break;
    default: pool_rows_of<0>(src, s, g, C, l, P, out);
  }
}

// dst[0:bytes) = src[0:bytes); `stream`: non-temporal stores where dst and
// the size are 16-byte aligned.
inline void copy_channels(void* dst, const void* src, size_t bytes,
                          bool stream) {
#if defined(__SSE2__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) % 16 == 0) &&
      bytes % 16 == 0) {
    auto* d = static_cast<__m128i*>(dst);
    const auto* s = static_cast<const __m128i*>(src);
    for (size_t i = 0; i < bytes / 16; ++i) {
      _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Every token of patch row P of image l in dst = its patch's C-vector of
// `cells` (Pw x C, contiguous): the first token row is expanded from the
// cells, the patch row's other token rows are copies of it (one long copy
// each where a token row is contiguous, as in every layout but an (N, B, C)
// input's).
template <typename scalar_t>
MMSEG_GF_VECTOR_CLONES void spread_patch_row(const scalar_t* cells,
                                             scalar_t* dst,
                                             const RowStrides& s,
                                             const Geometry& g, int64_t C,
                                             int64_t l, int64_t P,
                                             bool stream) {
  const int64_t h0 = P * g.r, h1 = h0 + g.rows_of(P);
  scalar_t* first = dst + s.token(l, h0, 0);
  for (int64_t q = 0; q < g.Pw; ++q) {
    const scalar_t* __restrict__ cell = cells + q * C;
    const int64_t w0 = q * g.r, w1 = w0 + g.cols_of(q);
    for (int64_t w = w0; w < w1; ++w) {
      scalar_t* __restrict__ token = first + w * s.w;
      for (int64_t c = 0; c < C; ++c) token[c] = cell[c];
    }
  }
  const bool dense_rows = s.w == C;
  for (int64_t h = h0 + 1; h < h1; ++h) {
    scalar_t* row = dst + s.token(l, h, 0);
    if (dense_rows) {
      copy_channels(row, first, sizeof(scalar_t) * g.W * C, stream);
    } else {
      for (int64_t w = 0; w < g.W; ++w) {
        copy_channels(row + w * s.w, first + w * s.w, sizeof(scalar_t) * C,
                      stream);
      }
    }
  }
}

// The means of a pooled patch row (Pw x C cells, their sums): `part` (C)
// receives the row's total over its cells first (its share of g_b), then
// every cell is scaled by 1 / (its tokens).
template <typename scalar_t>
MMSEG_GF_VECTOR_CLONES void means_of_patch_row(scalar_t* __restrict__ out,
                                               const Geometry& g, int64_t C,
                                               int64_t P,
                                               scalar_t* __restrict__ part) {
  if (part) {
    for (int64_t c = 0; c < C; ++c) part[c] = out[c];
    for (int64_t q = 1; q < g.Pw; ++q) {
      const scalar_t* __restrict__ cell = out + q * C;
      for (int64_t c = 0; c < C; ++c) part[c] += cell[c];
    }
  }
  for (int64_t q = 0; q < g.Pw; ++q) {
    const scalar_t inv =
        scalar_t(1) / static_cast<scalar_t>(g.rows_of(P) * g.cols_of(q));
    scalar_t* __restrict__ cell = out + q * C;
    for (int64_t c = 0; c < C; ++c) cell[c] *= inv;
  }
}

// Whether the AVX-512 passes (token_rows_avx512.h) take scalar_t's rows:
// float32 on a CPU with AVX-512F, unless switched off.
template <typename scalar_t>
bool avx512_rows() {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return token_rows_avx512_enabled();
  } else {
    return false;
  }
}

// pool_patch_row (then, where `means`, means_of_patch_row) on either path:
// the same sums, added in the same order.
template <typename scalar_t>
void pool_cells(const scalar_t* src, const RowStrides& s, const Geometry& g,
                int64_t C, int64_t l, int64_t P, bool means, bool vector,
                scalar_t* __restrict__ out, scalar_t* __restrict__ part) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (vector) {
      if (part) std::fill(part, part + C, 0.0f);
      pool_patch_row_avx512(src + s.token(l, P * g.r, 0), s.h, s.w, g.W,
                            g.r, g.rows_of(P), C, means, out, part);
      return;
    }
  }
  pool_patch_row(src, s, g, C, l, P, out);
  if (means) means_of_patch_row(out, g, C, P, part);
}

template <typename scalar_t>
void spread_cells(const scalar_t* cells, scalar_t* dst, const RowStrides& s,
                  const Geometry& g, int64_t C, int64_t l, int64_t P,
                  bool stream, bool vector) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (vector) {
      spread_patch_row_avx512(cells, dst + s.token(l, P * g.r, 0), s.h, s.w,
                              g.W, g.r, g.rows_of(P), C, stream);
      return;
    }
  }
  spread_patch_row(cells, dst, s, g, C, l, P, stream);
  if (stream) store_fence();
}

template <typename scalar_t>
void pool_all(const torch::Tensor& rows, const Geometry& g,
              const torch::Tensor& out) {
  const scalar_t* src = rows.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  const RowStrides s = RowStrides::of(rows);
  const int64_t C = rows.size(3);
  const bool vector = avx512_rows<scalar_t>();
  at::parallel_for(0, g.L * g.Ph, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      pool_cells<scalar_t>(src, s, g, C, u / g.Ph, u % g.Ph, false, vector,
                           dst + u * g.Pw * C, nullptr);
    }
  });
}

template <typename scalar_t>
void backward_kernel(const torch::Tensor& grad_rows, const Geometry& g,
                     const torch::Tensor& weight, const torch::Tensor& x_sums,
                     const torch::Tensor& grad_x_rows,
                     const torch::Tensor& grad_weight,
                     std::vector<double>* bias_totals, int64_t chunk_bytes,
                     int64_t stream_bytes) {
  const int64_t Co = grad_rows.size(3), Ci = weight.size(1);
  const bool need_input = grad_x_rows.defined();
  const bool need_weight = grad_weight.defined();
  const int64_t units = g.L * g.Ph;  // patch rows
  const int64_t cell_bytes =
      static_cast<int64_t>(sizeof(scalar_t)) * (Co + (need_input ? Ci : 0));
  const int64_t chunk = std::min(
      units, std::max<int64_t>(1, chunk_bytes / (cell_bytes * g.Pw)));
  const auto options = grad_rows.options();
  const torch::Tensor means_buf = torch::empty({chunk * g.Pw, Co}, options);
  const torch::Tensor mixed_buf =
      need_input ? torch::empty({chunk * g.Pw, Ci}, options) : torch::Tensor();
  // W^T as oneDNN's inner product takes its weight (rows_times_matrix)
  const torch::Tensor weight_t =
      need_input ? weight.t().contiguous() : torch::Tensor();
  const torch::Tensor x_cells =
      need_weight ? x_sums.view({units * g.Pw, Ci}) : torch::Tensor();

  const scalar_t* src = grad_rows.data_ptr<scalar_t>();
  const RowStrides s_in = RowStrides::of(grad_rows);
  scalar_t* means = means_buf.data_ptr<scalar_t>();
  scalar_t* dst = need_input ? grad_x_rows.data_ptr<scalar_t>() : nullptr;
  const RowStrides s_out =
      need_input ? RowStrides::of(grad_x_rows) : RowStrides{0, 0, 0};
  const bool stream =
      need_input && static_cast<int64_t>(sizeof(scalar_t)) * g.L * g.H *
                            g.W * Ci >= stream_bytes;
  const bool vector = avx512_rows<scalar_t>();
  // g_W's product in AVX-512 (token_rows_avx512.h) where products may leave
  // MKL (cpu_dispatch.h); x_sums and g_W are contiguous (checked)
  const bool own_product = vector && onednn_products_enabled();
  std::mutex totals_lock;

  for (int64_t u0 = 0; u0 < units; u0 += chunk) {
    const int64_t n = std::min(chunk, units - u0);
    // Step 1: patch sums, their totals (g_b), then means.
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> part(bias_totals ? Co : 0);
      std::vector<double> totals(bias_totals ? Co : 0, 0.0);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t u = u0 + i, P = u % g.Ph;
        scalar_t* out = means + i * g.Pw * Co;
        pool_cells<scalar_t>(src, s_in, g, Co, u / g.Ph, P, true, vector,
                             out, bias_totals ? part.data() : nullptr);
        if (bias_totals) {
          for (int64_t c = 0; c < Co; ++c) totals[c] += part[c];
        }
      }
      if (bias_totals) {
        std::lock_guard<std::mutex> guard(totals_lock);
        for (int64_t c = 0; c < Co; ++c) (*bias_totals)[c] += totals[c];
      }
    });
    const torch::Tensor chunk_means = means_buf.narrow(0, 0, n * g.Pw);
    if (need_weight) {  // Step 4: g_W += means^T x~
      const torch::Tensor cells = x_cells.narrow(0, u0 * g.Pw, n * g.Pw);
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (own_product) {  // threads take disjoint blocks of 8 rows
          const float* b = cells.data_ptr<float>();
          float* c = grad_weight.data_ptr<float>();
          at::parallel_for(0, (Co + 7) / 8, 1, [&](int64_t i0, int64_t i1) {
            const int64_t r0 = i0 * 8, r1 = std::min(i1 * 8, Co);
            add_transposed_product_avx512(means + r0, Co, b, c + r0 * Ci,
                                          n * g.Pw, r1 - r0, Ci);
          });
        } else {
          grad_weight.addmm_(chunk_means.t(), cells);
        }
      } else {
        grad_weight.addmm_(chunk_means.t(), cells);
      }
    }
    if (need_input) {  // Step 3: g_x~ = means W, spread over the patches
      const torch::Tensor mixed = rows_times_matrix(
          chunk_means, weight, weight_t, mixed_buf.narrow(0, 0, n * g.Pw));
      const scalar_t* cells = mixed.data_ptr<scalar_t>();
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t u = u0 + i;
          spread_cells<scalar_t>(cells + i * g.Pw * Ci, dst, s_out, g, Ci,
                                 u / g.Ph, u % g.Ph, stream, vector);
        }
      });
    }
  }
}

}  // namespace

torch::Tensor token_patch_sums(const torch::Tensor& rows, int64_t radius) {
  check_rows(rows, "rows");
  const Geometry g = geometry_of(rows, radius);
  torch::Tensor out =
      empty_for_writing({g.L, g.Ph, g.Pw, rows.size(3)}, rows.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "token_patch_sums",
                             [&] { pool_all<scalar_t>(rows, g, out); });
  return out;
}

std::vector<torch::Tensor> token_filtered_backward(
    const torch::Tensor& grad_rows, const c10::optional<torch::Tensor>& x_sums,
    const torch::Tensor& weight,
    const c10::optional<torch::Tensor>& grad_x_rows,
    int64_t radius, bool need_weight, bool need_bias, int64_t chunk_bytes,
    int64_t stream_bytes) {
  check_rows(grad_rows, "grad_rows");
  TORCH_CHECK(chunk_bytes >= 1 && stream_bytes >= 0,
              "chunk_bytes must be >= 1 and stream_bytes >= 0, got ",
              chunk_bytes, ", ", stream_bytes);
  const Geometry g = geometry_of(grad_rows, radius);
  const int64_t Co = grad_rows.size(3);
  const auto dtype = grad_rows.scalar_type();
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.size(0) == Co && weight.scalar_type() == dtype,
              "weight must be a CPU Co x Ci matrix of grad_rows' dtype with "
              "Co = ", Co, ", got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t Ci = weight.size(1);
  const bool need_input = grad_x_rows.has_value() && grad_x_rows->defined();
  torch::Tensor grad_x;
  if (need_input) {
    grad_x = *grad_x_rows;
    check_rows(grad_x, "grad_x_rows");
    TORCH_CHECK(grad_x.scalar_type() == dtype && grad_x.size(0) == g.L &&
                    grad_x.size(1) == g.H && grad_x.size(2) == g.W &&
                    grad_x.size(3) == Ci,
                "grad_x_rows must be ", g.L, " x ", g.H, " x ", g.W, " x ",
                Ci, " of grad_rows' dtype, got ", grad_x.sizes(), " ",
                grad_x.scalar_type());
  }
  torch::Tensor sums;
  if (need_weight) {
    TORCH_CHECK(x_sums.has_value() && x_sums->defined(),
                "the weight gradient needs the patch sums of x");
    sums = *x_sums;
    TORCH_CHECK(sums.device().is_cpu() && sums.is_contiguous() &&
                    sums.scalar_type() == dtype && sums.dim() == 4 &&
                    sums.size(0) == g.L && sums.size(1) == g.Ph &&
                    sums.size(2) == g.Pw && sums.size(3) == Ci,
                "x_sums must be a contiguous ", g.L, " x ", g.Ph, " x ", g.Pw,
                " x ", Ci, " CPU tensor of grad_rows' dtype, got ",
                sums.sizes(), " ", sums.scalar_type());
  }
  const torch::Tensor w = weight.contiguous();
  torch::Tensor grad_weight, grad_bias;
  if (need_weight) grad_weight = torch::zeros({Co, Ci}, grad_rows.options());
  std::vector<double> totals(need_bias ? Co : 0, 0.0);
  if (g.L * g.H * g.W > 0 && Co > 0) {
    AT_DISPATCH_FLOATING_TYPES(dtype, "token_filtered_backward", [&] {
      backward_kernel<scalar_t>(grad_rows, g, w, sums, grad_x, grad_weight,
                                need_bias ? &totals : nullptr, chunk_bytes,
                                stream_bytes);
    });
  } else if (need_input) {
    grad_x.zero_();
  }
  if (need_bias) {
    grad_bias = torch::tensor(totals, torch::dtype(torch::kFloat64))
                    .to(dtype);
  }
  return {grad_weight, grad_bias};
}

}  // namespace mmseg_gf
