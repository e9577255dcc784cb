// AVX-512 passes over float32 token rows (see token_rows_avx512.h).

#include "token_rows_avx512.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MMSEG_GF_AVX512_ROWS 1
#include <immintrin.h>
#endif

namespace mmseg_gf {
namespace {

std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

}  // namespace

#ifdef MMSEG_GF_AVX512_ROWS

bool token_rows_avx512_enabled() {
  static const bool cpu = __builtin_cpu_supports("avx512f");
  return cpu && switched_on().load(std::memory_order_relaxed);
}

namespace {

// Lanes [0, n) of a 16-float vector.
__attribute__((target("avx512f"))) inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// 16 floats from p, or the lanes of m only (the channels' tail): masked
// loads on every block were half as fast on Zen 5.
template <bool kTail>
__attribute__((target("avx512f"))) inline __m512 load(const float* p,
                                                      __mmask16 m) {
  if constexpr (kTail) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    return _mm512_loadu_ps(p);
  }
}

// The sum of a patch's rows x cols tokens (row-major within the patch, the
// portable loops' order) for channels [c, c + 16) masked by m: NR x NC
// known at compile time (the loads unrolled), or 0 x 0 for nr x nc.
template <int NR, int NC, bool kTail>
__attribute__((target("avx512f"))) inline __m512 patch_sum(
    const float* t, int64_t sh, int64_t sw, int64_t nr, int64_t nc,
    __mmask16 m) {
  const int64_t rows = NR > 0 ? NR : nr, cols = NC > 0 ? NC : nc;
  __m512 acc = load<kTail>(t, m);
#pragma GCC unroll 8
  for (int64_t j = 1; j < cols; ++j) {
    acc = _mm512_add_ps(acc, load<kTail>(t + j * sw, m));
  }
#pragma GCC unroll 8
  for (int64_t i = 1; i < rows; ++i) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < cols; ++j) {
      acc = _mm512_add_ps(acc, load<kTail>(t + i * sh + j * sw, m));
    }
  }
  return acc;
}

// The cell of one patch, channels [c, c + 16) (lanes m where kTail).
template <int NR, int NC, bool kTail>
__attribute__((target("avx512f"))) inline void pool_block(
    const float* t, int64_t sh, int64_t sw, int64_t nr, int64_t nc,
    bool means, __m512 vinv, __mmask16 m, float* cell, float* part) {
  const __m512 sum = patch_sum<NR, NC, kTail>(t, sh, sw, nr, nc, m);
  if (part) {
    _mm512_mask_storeu_ps(part, m, _mm512_add_ps(load<kTail>(part, m), sum));
  }
  _mm512_mask_storeu_ps(cell, m, means ? _mm512_mul_ps(sum, vinv) : sum);
}

// The cell of the patch of nr x nc tokens from t (its C channels).
template <int NR, int NC>
__attribute__((target("avx512f"))) void pool_patch(
    const float* t, int64_t sh, int64_t sw, int64_t nr, int64_t nc,
    int64_t C, bool means, float* cell, float* part) {
  const __m512 vinv =
      _mm512_set1_ps(means ? 1.0f / static_cast<float>(nr * nc) : 1.0f);
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    pool_block<NR, NC, false>(t + c, sh, sw, nr, nc, means, vinv, lanes(16),
                              cell + c, part ? part + c : nullptr);
  }
  if (c < C) {
    pool_block<NR, NC, true>(t + c, sh, sw, nr, nc, means, vinv,
                             lanes(C - c), cell + c,
                             part ? part + c : nullptr);
  }
}

using PoolPatch = void (*)(const float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, bool, float*, float*);

// pool_patch unrolled for patches of up to 4 x 4 tokens (whole and
// partial patches of r <= 4: Swin's 7 x 7 windows at r = 4 hold 4 x 4,
// 4 x 3, 3 x 4 and 3 x 3 ones) and whole 8 x 8 ones; loops otherwise.
PoolPatch pool_patch_for(int64_t nr, int64_t nc) {
#define MMSEG_GF_PATCH(a, b) \
  if (nr == a && nc == b) return &pool_patch<a, b>;
#define MMSEG_GF_PATCH_ROW(a) \
  MMSEG_GF_PATCH(a, 1)        \
  MMSEG_GF_PATCH(a, 2)        \
  MMSEG_GF_PATCH(a, 3)        \
  MMSEG_GF_PATCH(a, 4)
  MMSEG_GF_PATCH_ROW(1)
  MMSEG_GF_PATCH_ROW(2)
  MMSEG_GF_PATCH_ROW(3)
  MMSEG_GF_PATCH_ROW(4)
  MMSEG_GF_PATCH(8, 8)
#undef MMSEG_GF_PATCH_ROW
#undef MMSEG_GF_PATCH
  return &pool_patch<0, 0>;
}

template <bool kStream>
__attribute__((target("avx512f"))) void spread_row(
    const float* cells, float* first, int64_t sh, int64_t sw, int64_t W,
    int64_t r, int64_t rows, int64_t C) {
  const int64_t Pw = (W + r - 1) / r;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = first + i * sh;
    for (int64_t q = 0; q < Pw; ++q) {
      const int64_t cols = W - q * r < r ? W - q * r : r;
      float* t = row + q * r * sw;
      const float* cell = cells + q * C;
      int64_t c = 0;
      for (; c + 16 <= C; c += 16) {
        const __m512 v = _mm512_loadu_ps(cell + c);
        for (int64_t j = 0; j < cols; ++j) {
          if (kStream) {
            _mm512_stream_ps(t + j * sw + c, v);
          } else {
            _mm512_storeu_ps(t + j * sw + c, v);
          }
        }
      }
      if (c < C) {  // never where kStream (C % 16 == 0)
        const __mmask16 m = lanes(C - c);
        const __m512 v = _mm512_maskz_loadu_ps(m, cell + c);
        for (int64_t j = 0; j < cols; ++j) {
          _mm512_mask_storeu_ps(t + j * sw + c, m, v);
        }
      }
    }
  }
  if (kStream) _mm_sfence();
}

// Rows summed in registers before their sum is added to c: the rounding
// error then grows with kProductRows + n / kProductRows, not with n (with
// one register sum over all n rows it was twice MKL's).
constexpr int64_t kProductRows = 64;

// c[i0:i0+MR, j0:j0+32) += a[k0:k1, i0:i0+MR]^T b[k0:k1, j0:j0+32) (lanes
// m0, m1 of the two 16-float halves where kTail).
template <int MR, bool kTail>
__attribute__((target("avx512f"))) void product_block(
    const float* a, const float* b, float* c, int64_t k0, int64_t k1,
    int64_t Co, int64_t Ci, __mmask16 m0, __mmask16 m1) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = b + k * Ci;
    const __m512 b0 = load<kTail>(row, m0);
    const __m512 b1 = load<kTail>(row + 16, m1);
    const float* col = a + k * Co;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(col[i]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* out = c + i * Ci;
    _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(load<kTail>(out, m0), lo[i]));
    _mm512_mask_storeu_ps(out + 16, m1,
                          _mm512_add_ps(load<kTail>(out + 16, m1), hi[i]));
  }
}

template <int MR>
__attribute__((target("avx512f"))) void product_rows(
    const float* a, const float* b, float* c, int64_t n, int64_t Co,
    int64_t Ci) {
  for (int64_t k0 = 0; k0 < n; k0 += kProductRows) {
    const int64_t k1 = k0 + kProductRows < n ? k0 + kProductRows : n;
    int64_t j = 0;
    for (; j + 32 <= Ci; j += 32) {
      product_block<MR, false>(a, b + j, c + j, k0, k1, Co, Ci, lanes(16),
                               lanes(16));
    }
    if (j < Ci) {
      product_block<MR, true>(a, b + j, c + j, k0, k1, Co, Ci, lanes(Ci - j),
                              lanes(Ci - j - 16 > 0 ? Ci - j - 16 : 0));
    }
  }
}

}  // namespace

void add_transposed_product_avx512(const float* a, int64_t lda,
                                   const float* b, float* c, int64_t n,
                                   int64_t rows, int64_t Ci) {
  constexpr int kRows = 8;
  const int64_t Co = lda;  // a's row stride
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) {
    product_rows<kRows>(a + i, b, c + i * Ci, n, Co, Ci);
  }
  const float* at = a + i;
  float* ct = c + i * Ci;
  switch (rows - i) {  // the last rows % 8 rows of c
    case 1: product_rows<1>(at, b, ct, n, Co, Ci); break;
    case 2: product_rows<2>(at, b, ct, n, Co, Ci); break;
    case 3: product_rows<3>(at, b, ct, n, Co, Ci); break;
    case 4: product_rows<4>(at, b, ct, n, Co, Ci); break;
    case 5: product_rows<5>(at, b, ct, n, Co, Ci); break;
    case 6: product_rows<6>(at, b, ct, n, Co, Ci); break;
    case 7: product_rows<7>(at, b, ct, n, Co, Ci); break;
    default: break;
  }
}

void pool_patch_row_avx512(const float* first, int64_t sh, int64_t sw,
                           int64_t W, int64_t r, int64_t rows, int64_t C,
                           bool means, float* out, float* part) {
  const int64_t Pw = (W + r - 1) / r;
  for (int64_t q = 0; q < Pw; ++q) {
    const int64_t cols = W - q * r < r ? W - q * r : r;
    pool_patch_for(rows, cols)(first + q * r * sw, sh, sw, rows, cols, C,
                               means, out + q * C, part);
  }
}

void spread_patch_row_avx512(const float* cells, float* first, int64_t sh,
                             int64_t sw, int64_t W, int64_t r, int64_t rows,
                             int64_t C, bool stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(first) % 64 == 0 &&
                       C % 16 == 0 && sw % 16 == 0 && sh % 16 == 0;
  if (stream && aligned) {
    spread_row<true>(cells, first, sh, sw, W, r, rows, C);
  } else {
    spread_row<false>(cells, first, sh, sw, W, r, rows, C);
  }
}

#else  // no AVX-512 code in this build

bool token_rows_avx512_enabled() { return false; }

void pool_patch_row_avx512(const float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, bool, float*, float*) {
  std::abort();
}

void spread_patch_row_avx512(const float*, float*, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, bool) {
  std::abort();
}

void add_transposed_product_avx512(const float*, int64_t, const float*,
                                   float*, int64_t, int64_t, int64_t) {
  std::abort();
}

#endif

bool set_token_rows_avx512(bool enabled) {
  return switched_on().exchange(enabled);
}

}  // namespace mmseg_gf
