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

// The sum of nr x nc tokens (row-major within the patch, the portable
// loops' order) for channels [c, c + 16) masked by m.
template <bool kTail>
__attribute__((target("avx512f"))) inline __m512 patch_sum(
    const float* t, int64_t sh, int64_t sw, int64_t nr, int64_t nc,
    __mmask16 m) {
  __m512 acc = load<kTail>(t, m);
  for (int64_t j = 1; j < nc; ++j) {
    acc = _mm512_add_ps(acc, load<kTail>(t + j * sw, m));
  }
  for (int64_t i = 1; i < nr; ++i) {
    const float* row = t + i * sh;
    for (int64_t j = 0; j < nc; ++j) {
      acc = _mm512_add_ps(acc, load<kTail>(row + j * sw, m));
    }
  }
  return acc;
}

// patch_sum with nr = nc = N known at compile time (whole patches of
// r = 2, 4): the loads unrolled.
template <int N, bool kTail>
__attribute__((target("avx512f"))) inline __m512 whole_patch_sum(
    const float* t, int64_t sh, int64_t sw, __mmask16 m) {
  __m512 acc = load<kTail>(t, m);
#pragma GCC unroll 8
  for (int j = 1; j < N; ++j) {
    acc = _mm512_add_ps(acc, load<kTail>(t + j * sw, m));
  }
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      acc = _mm512_add_ps(acc, load<kTail>(t + i * sh + j * sw, m));
    }
  }
  return acc;
}

// The cell of one patch, channels [c, c + 16) (lanes m where kTail).
template <int N, bool kTail>
__attribute__((target("avx512f"))) inline void pool_block(
    const float* t, int64_t sh, int64_t sw, int64_t rows, int64_t cols,
    bool whole, bool means, __m512 vinv, __mmask16 m, float* cell,
    float* part) {
  const __m512 sum = whole ? whole_patch_sum<N, kTail>(t, sh, sw, m)
                           : patch_sum<kTail>(t, sh, sw, rows, cols, m);
  if (part) {
    _mm512_mask_storeu_ps(part, m, _mm512_add_ps(load<kTail>(part, m), sum));
  }
  _mm512_mask_storeu_ps(cell, m, means ? _mm512_mul_ps(sum, vinv) : sum);
}

template <int N>
__attribute__((target("avx512f"))) void pool_row(
    const float* first, int64_t sh, int64_t sw, int64_t W, int64_t r,
    int64_t rows, int64_t C, bool means, float* out, float* part) {
  const int64_t Pw = (W + r - 1) / r;
  for (int64_t q = 0; q < Pw; ++q) {
    const int64_t cols = W - q * r < r ? W - q * r : r;
    const bool whole = N > 0 && rows == N && cols == N;
    const float inv =
        means ? 1.0f / static_cast<float>(rows * cols) : 1.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const float* t = first + q * r * sw;
    float* cell = out + q * C;
    float* bias = part;
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
      pool_block<N, false>(t + c, sh, sw, rows, cols, whole, means, vinv,
                           lanes(16), cell + c, bias ? bias + c : nullptr);
    }
    if (c < C) {
      pool_block<N, true>(t + c, sh, sw, rows, cols, whole, means, vinv,
                          lanes(C - c), cell + c, bias ? bias + c : nullptr);
    }
  }
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

}  // namespace

void pool_patch_row_avx512(const float* first, int64_t sh, int64_t sw,
                           int64_t W, int64_t r, int64_t rows, int64_t C,
                           bool means, float* out, float* part) {
  switch (r) {
    case 2: pool_row<2>(first, sh, sw, W, r, rows, C, means, out, part); break;
    case 4: pool_row<4>(first, sh, sw, W, r, rows, C, means, out, part); break;
    default: pool_row<0>(first, sh, sw, W, r, rows, C, means, out, part);
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

#endif

bool set_token_rows_avx512(bool enabled) {
  return switched_on().exchange(enabled);
}

}  // namespace mmseg_gf
