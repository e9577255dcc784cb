// Bit masks for the lean trained region: an activation's backward needs only
// one bit per element (does the gradient pass, or is it scaled), so the
// forward keeps that bit instead of the full float tensor (1/32 of the bytes
// of a float32 map).
//
// Layout (shared with the PyTorch fallback in mmseg_gf/ops/bit_mask/masks.py):
// element i of the tensor in memory order is bit (i % 8) of byte (i / 8);
// the last byte's unused bits are 0.
//
// Bit of element v: v > lo && v < hi (hi = +inf: no upper bound, so that
// +inf passes as in ReLU's backward), except that a NaN gets `nan_bit`
// (ReLU and Hardtanh pass the gradient of a NaN, LeakyReLU scales it).
// Comparisons are made in the element's own precision (double for double).
// torch/extension.h without the C++ frontend (nn, optim, ...): tensors
// and their pybind11 conversions parse in 60% of its time.
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MMSEG_GF_X86 1
#define MMSEG_GF_VECTOR_BYTES 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define MMSEG_GF_NEON 1
#define MMSEG_GF_VECTOR_BYTES 1
#endif

namespace {

// Bytes per parallel task: large enough that the split costs nothing.
constexpr int64_t kGrain = 1 << 14;

#ifdef MMSEG_GF_X86
// float32 on AVX2 CPUs (checked at run time; the extension is compiled for
// the baseline ISA): one compare-and-movemask per 8 elements, one blend per
// 8 gradients. The scalar loops below were 3-6x slower than the activation
// itself, which would make the lean step slower than the plain one.
bool vector_bytes() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

__attribute__((target("avx2"))) void pack_bytes_vector(
    const float* x, uint8_t* out, int64_t begin, int64_t end, float lo,
    float hi, bool bounded, bool nan_bit) {
  const __m256 vlo = _mm256_set1_ps(lo);
  const __m256 vhi = _mm256_set1_ps(hi);
  for (int64_t b = begin; b < end; ++b) {
    const __m256 v = _mm256_loadu_ps(x + b * 8);
    __m256 bit = _mm256_cmp_ps(v, vlo, _CMP_GT_OQ);  // NaN: false
    if (bounded) bit = _mm256_and_ps(bit, _mm256_cmp_ps(v, vhi, _CMP_LT_OQ));
    if (nan_bit) bit = _mm256_or_ps(bit, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    out[b] = static_cast<uint8_t>(_mm256_movemask_ps(bit));
  }
}

__attribute__((target("avx2"))) void apply_bytes_vector(
    const float* g, const uint8_t* bits, float* out, int64_t begin,
    int64_t end, float off_scale, bool zero_off) {
  const __m256i weights = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 scale = _mm256_set1_ps(off_scale);
  for (int64_t b = begin; b < end; ++b) {
    const __m256i byte = _mm256_set1_epi32(bits[b]);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(byte, weights), weights));
    const __m256 v = _mm256_loadu_ps(g + b * 8);
    const __m256 off =
        zero_off ? _mm256_setzero_ps() : _mm256_mul_ps(v, scale);
    _mm256_storeu_ps(out + b * 8, _mm256_blendv_ps(off, v, keep));
  }
}
#elif defined(MMSEG_GF_NEON)
// float32 on aarch64 (NEON is part of the base ISA): the same compares and
// blends as the AVX2 code, 4 lanes at a time; a byte's 8 bits are the sum
// of its lanes' masks ANDed with their bit weights.
bool vector_bytes() { return true; }

const uint32_t kBitWeights[8] = {1, 2, 4, 8, 16, 32, 64, 128};

void pack_bytes_vector(const float* x, uint8_t* out, int64_t begin,
                       int64_t end, float lo, float hi, bool bounded,
                       bool nan_bit) {
  const float32x4_t vlo = vdupq_n_f32(lo);
  const float32x4_t vhi = vdupq_n_f32(hi);
  const uint32x4_t w0 = vld1q_u32(kBitWeights);
  const uint32x4_t w1 = vld1q_u32(kBitWeights + 4);
  const auto lane_bits = [&](const float* p) {
    const float32x4_t v = vld1q_f32(p);
    uint32x4_t bit = vcgtq_f32(v, vlo);  // NaN: false
    if (bounded) bit = vandq_u32(bit, vcltq_f32(v, vhi));
    if (nan_bit) bit = vorrq_u32(bit, vmvnq_u32(vceqq_f32(v, v)));
    return bit;
  };
  for (int64_t b = begin; b < end; ++b) {
    const uint32x4_t bits = vorrq_u32(vandq_u32(lane_bits(x + b * 8), w0),
                                      vandq_u32(lane_bits(x + b * 8 + 4), w1));
    out[b] = static_cast<uint8_t>(vaddvq_u32(bits));
  }
}

void apply_bytes_vector(const float* g, const uint8_t* bits, float* out,
                        int64_t begin, int64_t end, float off_scale,
                        bool zero_off) {
  const uint32x4_t w0 = vld1q_u32(kBitWeights);
  const uint32x4_t w1 = vld1q_u32(kBitWeights + 4);
  const float32x4_t scale = vdupq_n_f32(off_scale);
  const auto blend = [&](const float* src, float* dst, uint32x4_t keep) {
    const float32x4_t v = vld1q_f32(src);
    const float32x4_t off = zero_off ? vdupq_n_f32(0.f) : vmulq_f32(v, scale);
    vst1q_f32(dst, vbslq_f32(keep, v, off));
  };
  for (int64_t b = begin; b < end; ++b) {
    const uint32x4_t byte = vdupq_n_u32(bits[b]);
    blend(g + b * 8, out + b * 8, vtstq_u32(byte, w0));
    blend(g + b * 8 + 4, out + b * 8 + 4, vtstq_u32(byte, w1));
  }
}
#endif

template <typename scalar_t>
void pack_bits(const scalar_t* x, uint8_t* out, int64_t n, double lo_d,
               double hi_d, bool nan_bit) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t lo = static_cast<acc_t>(lo_d);
  const acc_t hi = static_cast<acc_t>(hi_d);
  const bool bounded = std::isfinite(hi_d);
  const int64_t bytes = (n + 7) / 8;
  at::parallel_for(0, bytes, kGrain, [&](int64_t begin, int64_t end) {
#ifdef MMSEG_GF_VECTOR_BYTES
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (vector_bytes()) {
        const int64_t full = std::min(end, n / 8);  // bytes of 8 elements
        if (begin < full) {
          pack_bytes_vector(x, out, begin, full, lo, hi, bounded, nan_bit);
          begin = full;
        }
      }
    }
#endif
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * 8;
      const int64_t count = std::min<int64_t>(8, n - first);
      uint8_t byte = 0;
      for (int64_t k = 0; k < count; ++k) {
        const acc_t v = static_cast<acc_t>(x[first + k]);
        const bool bit =
            std::isnan(v) ? nan_bit : (v > lo && (!bounded || v < hi));
        byte |= static_cast<uint8_t>(bit) << k;
      }
      out[b] = byte;
    }
  });
}

// out[i] = bit ? g[i] : g[i] * off_scale, with an exact 0 where off_scale
// is 0 (as ReLU's backward writes, also for an infinite g).
template <typename scalar_t>
void apply_bits(const scalar_t* g, const uint8_t* bits, scalar_t* out,
                int64_t n, double off_scale) {
  const int64_t bytes = (n + 7) / 8;
  using acc_t = at::opmath_type<scalar_t>;
  const bool zero_off = off_scale == 0.0;
  const acc_t scale = static_cast<acc_t>(off_scale);
  at::parallel_for(0, bytes, kGrain, [&](int64_t begin, int64_t end) {
#ifdef MMSEG_GF_VECTOR_BYTES
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (vector_bytes()) {
        const int64_t full = std::min(end, n / 8);
        if (begin < full) {
          apply_bytes_vector(g, bits, out, begin, full,
                           static_cast<float>(off_scale), zero_off);
          begin = full;
        }
      }
    }
#endif
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * 8;
      const int64_t count = std::min<int64_t>(8, n - first);
      const uint8_t byte = bits[b];
      for (int64_t k = 0; k < count; ++k) {
        const scalar_t v = g[first + k];
        const scalar_t off =
            zero_off ? scalar_t(0)
                     : static_cast<scalar_t>(static_cast<acc_t>(v) * scale);
        out[first + k] = ((byte >> k) & 1) ? v : off;
      }
    }
  });
}

void check_dense_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " must be a tensor");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

at::Tensor pack_mask(const at::Tensor& x, double lo, double hi, bool nan_bit) {
  check_dense_cpu(x, "x");
  const int64_t n = x.numel();
  at::Tensor out = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "pack_mask", [&] {
        pack_bits<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<uint8_t>(),
                            n, lo, hi, nan_bit);
      });
  return out;
}

at::Tensor apply_mask(const at::Tensor& grad, const at::Tensor& bits,
                      double off_scale, c10::optional<at::Tensor> out_memory) {
  check_dense_cpu(grad, "grad");
  check_dense_cpu(bits, "bits");
  TORCH_CHECK(bits.scalar_type() == at::kByte, "bits must be uint8");
  const int64_t n = grad.numel();
  TORCH_CHECK(bits.numel() == (n + 7) / 8, "bits hold ", bits.numel(),
              " bytes, the gradient needs ", (n + 7) / 8);
  // (out_memory: where to write, e.g. a recycled block; grad's shape and
  // dtype, contiguous)
  at::Tensor out = out_memory.has_value() ? *out_memory : at::empty_like(grad);
  check_dense_cpu(out, "out");
  TORCH_CHECK(out.sizes() == grad.sizes() &&
                  out.scalar_type() == grad.scalar_type(),
              "out must have the gradient's shape and dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, grad.scalar_type(), "apply_mask", [&] {
        apply_bits<scalar_t>(grad.data_ptr<scalar_t>(),
                             bits.data_ptr<uint8_t>(),
                             out.data_ptr<scalar_t>(), n, off_scale);
      });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Bit masks of activations for the lean trained region";
  m.def("pack_mask", &pack_mask, "1 bit per element: lo < x < hi",
        py::arg("x"), py::arg("lo"), py::arg("hi"), py::arg("nan_bit"));
  m.def("apply_mask", &apply_mask,
        "grad where the bit is set, grad * off_scale elsewhere",
        py::arg("grad"), py::arg("bits"), py::arg("off_scale"),
        py::arg("out") = py::none());
}
