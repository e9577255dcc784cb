// CPU dispatch of the fused backward's products (see cpu_dispatch.h).
//
// The rule: a product goes to oneDNN (as a 1x1 convolution) only on AMD
// CPUs with full-width AVX-512, only in float32 with one group, only when
// all three dimensions are at least kOneDnnMinDim, and only when at most
// kOneDnnMaxCopyBytes of transposed operand must be made contiguous first.
// Everything else is one MKL batched GEMM. set_onednn_products() overrides
// the CPU test (mmseg_gf.ops.backend.native.set_onednn_products).
//
// The reason: torch's matmuls call MKL, which takes its AVX2 code on every
// AMD CPU, while oneDNN runs AVX-512 wherever it exists. Only where 512-bit
// instructions also do twice the work of 256-bit ones (Zen 5) is oneDNN's
// convolution faster, up to 2x on the large products; on Zen 4, which
// splits them in two, MKL's GEMM beats the convolution route on every
// product of the layer benchmark (docs/benchmarks). On Intel CPUs MKL uses
// AVX-512 itself; the rule keeps them on MKL (the oneDNN route is untested
// there). The size bounds follow below, at grouped_matmul.

#include "cpu_dispatch.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>

#include "output_recycler.h"

namespace mmseg_gf {
namespace {

// Products whose three dimensions are all at least this long go to oneDNN
// (see grouped_matmul), if no more than this many bytes must be copied.
constexpr int64_t kOneDnnMinDim = 384;
constexpr int64_t kOneDnnMaxCopyBytes = int64_t(8) << 20;

// rows_times_matrix's products of this many multiply-adds or more go to
// oneDNN's inner product: below it the call's fixed cost (about 12 us
// against MKL's 2-4 us) outweighs the faster arithmetic (float32, one Zen 5
// core: 2048 x 64 x 64 takes 80 us there, 162 us in MKL; 256 x 64 x 64
// is even at 20 us).
constexpr int64_t kOneDnnMinRowMacs = int64_t(1) << 21;

// May large float32 products take the oneDNN route? By default on the CPUs
// where it is faster (above); set_onednn_products() overrides it.
std::atomic<bool>& onednn_products() {
  static std::atomic<bool> enabled{amd_cpu_with_full_width_avx512()};
  return enabled;
}

}  // namespace

bool amd_cpu_with_full_width_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amd = ebx == 0x68747541 && edx == 0x69746e65 &&
                   ecx == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__builtin_cpu_supports("avx512f")) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  unsigned family = (eax >> 8) & 0xf;
  if (family == 0xf) family += (eax >> 20) & 0xff;
  return family >= 0x1a;
#else
  return false;
#endif
}

bool set_onednn_products(bool enabled) {
  return onednn_products().exchange(enabled);
}

bool onednn_products_enabled() { return onednn_products().load(); }

// A 1x1 convolution is the same product as a GEMM (b as K input channels
// over S pixels, a as M filters of K weights), and at::conv2d runs it on
// oneDNN's forward convolution (its weight-gradient primitive is no
// alternative: up to 6x slower than the GEMM with 1024 input channels).
// But the convolution writes its output and blocked copies of its operands
// into fresh memory, whose page faults grow with the largest of the three
// matrices while the saving grows with the multiply-adds: their ratio is
// the smallest dimension. Hence kOneDnnMinDim: in the layer benchmark (cold
// caches, right after a vanilla backward) the convolution wins with all
// three dimensions at least 392 (512 x 512 x 2400: 1.5x; 512 x 512 x 392:
// 1.1-1.3x) and loses with one of 256 or 128 (256 x 256 x 9600: 1.3x
// slower; 128 x 128 x 9600: up to 1.7x), although warm and alone it wins
// on those too. Copying a large transposed operand costs the same way,
// hence kOneDnnMaxCopyBytes: 1024 x 1024 x 2048 with an 8 MB copy wins
// 1.8x, 512 x 512 x 32768 with a 64 MB one loses 1.3x (cold products
// alone). Copies go into recycled memory.
torch::Tensor grouped_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t groups = a.size(0), M = a.size(1), K = a.size(2);
  const int64_t S = b.size(2);
  const int64_t copied_bytes =
      ((a.is_contiguous() ? 0 : M * K) + (b.is_contiguous() ? 0 : K * S)) *
      static_cast<int64_t>(a.element_size());
  if (onednn_products().load() && groups == 1 &&
      a.scalar_type() == at::kFloat && std::min({M, K, S}) >= kOneDnnMinDim &&
      copied_bytes <= kOneDnnMaxCopyBytes) {
    // Autocast (if the caller left it on) must not lower the precision.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(
        c10::autocast_dispatch_keyset);
    const auto dense = [](const torch::Tensor& t) {
      return t.is_contiguous()
                 ? t
                 : empty_for_writing(t.sizes(), t.options()).copy_(t);
    };
    return at::conv2d(dense(b).view({1, K, 1, S}),
                      dense(a).view({M, K, 1, 1}))
        .view({1, M, S});
  }
  torch::Tensor out = empty_for_writing({groups, M, S}, a.options());
  at::bmm_out(out, a, b);
  return out;
}

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&,
                                   c10::string_view,
                                   c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

// torch's oneDNN inner product (y = x w^T), or nullptr where this torch
// build has none.
const c10::TypedOperatorHandle<LinearPointwise>* onednn_linear() {
  static const auto handle = []() {
    std::optional<c10::TypedOperatorHandle<LinearPointwise>> op;
    const auto found = c10::Dispatcher::singleton().findSchema(
        {"mkldnn::_linear_pointwise", ""});
    if (found.has_value() && found->hasKernelForDispatchKey(
                                 c10::DispatchKey::CPU)) {
      op = found->typed<LinearPointwise>();
    }
    return op;
  }();
  return handle.has_value() ? &*handle : nullptr;
}

}  // namespace

// torch's matmuls stay on MKL for float32 (AVX2 on AMD CPUs); oneDNN's
// inner product runs AVX-512 and, unlike the convolution route of
// grouped_matmul, writes no blocked copies: with the patch means as its
// input and W^T as its weight it ran the filtered Linear's input-gradient
// product 2.4-2.6x faster than MKL (n = 8192-11552 rows, K, N = 64-384,
// float32, one Zen 5 core; the same products to float32 rounding).
torch::Tensor rows_times_matrix(const torch::Tensor& a, const torch::Tensor& b,
                                const torch::Tensor& b_t,
                                const torch::Tensor& out) {
  const int64_t n = a.size(0), K = a.size(1), N = b.size(1);
  const auto* linear = onednn_linear();
  if (linear && onednn_products().load() && a.scalar_type() == at::kFloat &&
      n * K * N >= kOneDnnMinRowMacs) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(
        c10::autocast_dispatch_keyset);
    return linear->call(a, b_t, std::nullopt, "none",
                        c10::List<std::optional<at::Scalar>>(),
                        std::nullopt);
  }
  if (out.defined()) return at::mm_out(const_cast<torch::Tensor&>(out), a, b);
  return at::mm(a, b);
}

}  // namespace mmseg_gf
