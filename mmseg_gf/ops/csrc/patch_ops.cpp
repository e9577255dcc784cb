// CPU kernels of the gradient filter, from the bottom up: the two passes
// over full-size tensors (patch_sums, spread), the whole backward of the
// usual conv in one call (collapsed_backward, with its two products in
// grouped_matmul), and that conv as a C++ autograd node
// (GradientFilteredConv2d).
//
// Both full-size passes touch every element of an NCHW tensor exactly once
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
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <sys/mman.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct Axis {
  int64_t extent;  // pixels in the map
  int64_t start;   // first pixel of patch 0 (may be < 0)
  int64_t size;    // pixels per patch
  int64_t count;   // number of patches
  // The patches that lie wholly inside the map: [first_whole, last_whole).
  // Only they take the fixed-size fast loops below; the (at most two)
  // border patches take the general clipped loop. Computed once (see
  // make_axis): the kernels visit them for every row of every plane.
  int64_t first_whole;
  int64_t last_whole;

  // First and one-past-last pixel of patch p inside the map (lo <= hi).
  int64_t clip(int64_t v) const {
    return std::min<int64_t>(std::max<int64_t>(v, 0), extent);
  }
  int64_t lo(int64_t p) const { return clip(start + p * size); }
  int64_t hi(int64_t p) const { return clip(start + (p + 1) * size); }
};

Axis make_axis(int64_t extent, int64_t start, int64_t size, int64_t count) {
  TORCH_CHECK(size >= 1 && count >= 1, "patch size and count must be >= 1");
  const int64_t first = std::max<int64_t>(0, (-start + size - 1) / size);
  const int64_t last = std::min<int64_t>(
      count, start + size * count <= extent ? count : (extent - start) / size);
  return Axis{extent, start, size, count, std::min(first, last), last};
}

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

GridLayout nchw_layout(int64_t channels, int64_t cells) {
  return GridLayout{channels, channels * cells, cells};
}

GridLayout cnhw_layout(int64_t batch, int64_t channels, int64_t cells) {
  return GridLayout{channels, cells, batch * cells};
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
// Short rows of the usual patch heights are added in one pass (one store
// per column instead of one per row): on small maps, which the caches
// hold, this loop is most of the pooling time. Long rows are read one after
// the other instead: on the 2-core AMD VM we measured, reading two or four
// rows side by side from memory ran at 1/2 to 1/3 of the speed of one
// sequential stream once rows were longer than ~110 floats (a 78 MB
// 128x120x160 batch: 8.1 ms vs 3.8 ms single-threaded), and at the same
// speed for rows up to 80 floats.
template <typename scalar_t, typename acc_t>
void add_rows(const scalar_t* plane, int64_t W, int64_t h0, int64_t h1,
              acc_t* __restrict__ row) {
  constexpr int64_t kShortRowBytes = 320;
  const bool short_rows = W * static_cast<int64_t>(sizeof(scalar_t)) <= kShortRowBytes;
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
                       const Axis& ah, const Axis& aw, const GridLayout& out_layout,
                       const PatchReduction<acc_t>& how) {
  const int64_t H = ah.extent, W = aw.extent;
  const int64_t cells = ah.count * aw.count;
  // scale / (valid pixels) of every patch, for the means. Output patches
  // start at 0 and number ceil(extent / r): none is empty. Like every
  // per-patch quantity here it is computed once, not per plane: on small
  // maps (a 14x14 map is 16 patches) per-row work, not the data, set the
  // time (8 x 512 x 14 x 14 pooled at r = 4, warm: 246 -> 179 us).
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
                   const Axis& ah, const Axis& aw, const GridLayout& in_layout) {
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

// Fresh memory for a large tensor that a pass writes in full.
//
// With 4 KiB pages the first write to every page of new memory is a page
// fault: on the 2-core VM we measured, faulting in a 78 MB g_x took 23 ms,
// writing it 7 ms. Advising transparent huge pages (Linux "madvise" mode,
// the usual default) for the 2 MiB-aligned part before the first write cuts
// the faults 512-fold. torch's own switch for this, THP_MEM_ALLOC_ENABLE=1,
// does the same for every allocation of the process; here only our outputs
// are concerned. The advice changes no data and no allocator.
constexpr int64_t kHugePage = int64_t(2) << 20;
constexpr int64_t kHugePageAdviceBytes = 4 * kHugePage;
constexpr int64_t kRecycleBytes = int64_t(128) << 10;

torch::Tensor fresh_for_writing(at::IntArrayRef sizes,
                                const at::TensorOptions& options) {
  torch::Tensor t = torch::empty(sizes, options);
#ifdef MADV_HUGEPAGE
  const uintptr_t first = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (static_cast<int64_t>(t.nbytes()) >= kHugePageAdviceBytes) {
    const uintptr_t huge = static_cast<uintptr_t>(kHugePage);
    const uintptr_t begin = (first + huge - 1) & ~(huge - 1);
    const uintptr_t end = (first + t.nbytes()) & ~(huge - 1);
    // Advice only: if the kernel refuses, the pages are simply small.
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// Keeps the memory of large outputs freed by one backward for the next.
//
// Fresh memory stays expensive even with huge pages on a VM whose host
// takes back free guest memory (free page reporting, as on the Firecracker
// VM we measured): the same 78 MB spread took 6 ms when its huge pages were
// still backed by the host and 86-97 ms when they were not, about one call
// in three right after a vanilla backward had freed as much. Training calls
// the same layers with the same shapes every step, so a block freed by one
// step fits the next one exactly: as torch's CUDA allocator does on GPUs,
// blocks of kRecycleBytes or more go back to a small pool when their tensor
// dies and are lent out again for the same byte size. That bound is glibc's
// default mmap threshold: smaller blocks come from malloc's heap, which
// reuses memory already; larger ones are fresh mappings, whose page faults
// cost the small layers too: 64x64@56x56 with g_x (6.4 MB), r = 2, right
// after a vanilla backward took 4.4 ms with an 8 MiB bound, 2.5 ms with
// this one (weight-only calls, with their sub-MiB grids, did not change).
//
// The pool holds at most `limit` bytes (MMSEG_GF_RECYCLE_MB, default 256;
// 0 turns it off), least recently returned blocks are freed first, and
// release() frees everything (as torch.cuda.empty_cache does). Blocks are
// ordinary torch allocations (a byte tensor owns each one), so memory
// profilers count them, pooled or lent.
class OutputRecycler {
 public:
  static OutputRecycler& instance() {
    // Never destroyed: tensors freed during interpreter shutdown still
    // return their blocks here.
    static OutputRecycler* recycler = new OutputRecycler();
    return *recycler;
  }

  torch::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const int64_t bytes = c10::multiply_integers(sizes) *
                          static_cast<int64_t>(options.dtype().itemsize());
    if (bytes < kRecycleBytes || bytes > limit()) {
      return fresh_for_writing(sizes, options);
    }
    torch::Tensor owner = take(bytes);
    if (!owner.defined()) {
      owner = fresh_for_writing({bytes}, options.dtype(torch::kUInt8));
    }
    void* data = owner.data_ptr();
    return torch::from_blob(
        data, sizes,
        [this, owner](void*) mutable { give_back(std::move(owner)); },
        options);
  }

  int64_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  // Sets the limit (freeing blocks above it); returns the previous one.
  int64_t set_limit(int64_t bytes) {
    std::vector<torch::Tensor> freed;
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t previous = limit_;
    limit_ = std::max<int64_t>(bytes, 0);
    trim(freed);
    return previous;
  }

  int64_t held_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_bytes_;
  }

  void release() { set_limit(set_limit(0)); }

 private:
  OutputRecycler() {
    const char* env = std::getenv("MMSEG_GF_RECYCLE_MB");
    limit_ = (env ? std::max<int64_t>(std::atoll(env), 0) : 256) << 20;
  }

  torch::Tensor take(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (static_cast<int64_t>(it->nbytes()) == bytes) {
        torch::Tensor owner = std::move(*it);
        held_.erase(it);
        held_bytes_ -= bytes;
        return owner;
      }
    }
    return {};
  }

  void give_back(torch::Tensor owner) {
    std::vector<torch::Tensor> freed;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(mutex_);
    held_bytes_ += static_cast<int64_t>(owner.nbytes());
    held_.push_front(std::move(owner));
    trim(freed);
  }

  void trim(std::vector<torch::Tensor>& freed) {  // mutex_ held
    while (held_bytes_ > limit_) {
      held_bytes_ -= static_cast<int64_t>(held_.back().nbytes());
      freed.push_back(std::move(held_.back()));
      held_.pop_back();
    }
  }

  std::mutex mutex_;
  std::deque<torch::Tensor> held_;  // most recently returned first
  int64_t held_bytes_ = 0;
  int64_t limit_ = 0;
};

// A tensor for a pass that writes all of it once (g_x, patch grids).
torch::Tensor empty_for_writing(at::IntArrayRef sizes,
                                const at::TensorOptions& options) {
  return OutputRecycler::instance().empty(sizes, options);
}

// Products whose three dimensions are all at least this long go to oneDNN
// (see grouped_matmul), if no more than this many bytes must be copied.
constexpr int64_t kOneDnnMinDim = 384;
constexpr int64_t kOneDnnMaxCopyBytes = int64_t(8) << 20;

// Whether this CPU is an AMD one that executes AVX-512 at full width: Zen 5
// (family 1Ah) and later. MKL, which torch's matmuls call, takes its AVX2
// code on every AMD CPU; oneDNN runs AVX-512 wherever it exists. Only where
// 512-bit instructions also do twice the work of 256-bit ones does that
// make oneDNN faster. Zen 4 (family 19h) splits them in two: on the Zen 4
// VM we measured, MKL's GEMM beat the convolution route on every product
// of the benchmark (512 x 512 x 392: 1.06 vs 1.52 ms warm, 1.39 vs 1.85 ms
// right after a vanilla backward; 256 x 256 x 9600: 7.0 vs 15.5 ms warm).
// On Intel CPUs MKL uses AVX-512 itself; we have not measured them.
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

// May large float32 products take the oneDNN route? By default where it was
// measured faster (above); set_onednn_products() overrides it.
std::atomic<bool>& onednn_products() {
  static std::atomic<bool> enabled{amd_cpu_with_full_width_avx512()};
  return enabled;
}

// out[g] = a[g] b[g] per group, for groups x M x K and groups x K x S
// operands of any strides; out is groups x M x S, contiguous.
//
// On the AMD EPYC (Zen 5) VM we measured, MKL's sgemm ran at half the speed
// of oneDNN's convolutions: 512 x 512 x 392 took 1.05 ms as a GEMM and
// 0.60 ms as a 1x1 convolution, which is the same product (b as K input
// channels over S pixels, a as M filters of K weights). So, where
// onednn_products() allows it, float32 products of one group may run as
// at::conv2d, oneDNN's forward convolution (its
// weight-gradient primitive, tried too, took up to 6x longer than the GEMM
// with 1024 input channels), after copying a transposed operand
// contiguous (into recycled memory). But the convolution writes its output
// and blocked copies of its operands into fresh memory, whose page faults
// grow with the largest of the three matrices while the saving grows with
// the multiply-adds: their ratio is the smallest dimension. In the layer
// benchmark (cold caches, right after a vanilla backward) the convolution
// won with all three dimensions at least 392 (the layers' backward at
// r = 2: 512x512@30x40 with g_x, 512 x 512 x 2400, 1.5x faster;
// 512x512@14x14, 512 x 512 x 392, 1.1-1.3x) and lost with one of 256 or
// 128 (256x256@60x80 with g_x at r = 2, 256 x 256 x 9600: 1.3x slower;
// 128 x 128 x 9600: up to 1.7x), although warm and alone it won on those
// too. Copying a large transposed operand costs the same way:
// 1024 x 1024 x 2048 with an 8 MB copy won 1.8x, 512 x 512 x 32768 with a
// 64 MB one lost 1.3x (cold products alone).
torch::Tensor grouped_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t groups = a.size(0), M = a.size(1), K = a.size(2);
  const int64_t S = b.size(2);
  const int64_t copied_bytes =
      ((a.is_contiguous() ? 0 : M * K) + (b.is_contiguous() ? 0 : K * S)) *
      static_cast<int64_t>(a.element_size());
  if (onednn_products().load() && groups == 1 && a.scalar_type() == at::kFloat &&
      std::min({M, K, S}) >= kOneDnnMinDim &&
      copied_bytes <= kOneDnnMaxCopyBytes) {
    // Autocast (if the caller left it on) must not lower the precision.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto dense = [](const torch::Tensor& t) {
      return t.is_contiguous() ? t
                               : empty_for_writing(t.sizes(), t.options()).copy_(t);
    };
    return at::conv2d(dense(b).view({1, K, 1, S}), dense(a).view({M, K, 1, 1}))
        .view({1, M, S});
  }
  torch::Tensor out = empty_for_writing({groups, M, S}, a.options());
  at::bmm_out(out, a, b);
  return out;
}

void check_input(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 4, name, " must be N x C x H x W");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (NCHW)");
}

}  // namespace

// Patch sums of a contiguous NCHW tensor; float32 accumulation for float32
// input, float64 for float64. With `channel_major` the result is still
// indexed N x C x count_h x count_w but its memory is C x N x count_h x
// count_w, the layout the fused backward multiplies without copying.
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
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "patch_sums", [&] {
    patch_sums_kernel<scalar_t, scalar_t>(input.data_ptr<scalar_t>(),
                                          out.data_ptr<scalar_t>(), N * C, ah, aw,
                                          layout, PatchReduction<scalar_t>{});
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
  auto out = empty_for_writing({grid.size(0), grid.size(1), height, width},
                               grid.options());
  const int64_t N = grid.size(0), C = grid.size(1);
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "spread", [&] {
    spread_kernel<scalar_t>(grid.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            N * C, ah, aw,
                            nchw_layout(C, grid.size(2) * grid.size(3)));
  });
  return out;
}

// How many times collapsed_backward ran (from either autograd path).
std::atomic<int64_t>& fused_backward_calls() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

// The whole gradient-filter backward of a conv whose kernel collapses on
// both axes (every tap within one patch: steps 1-4 of
// docs/gradient_filter.md#backward), in one call.
//
// The Python path does the same in ~15 ATen calls (pool, means, permuting
// copies, GEMMs, spread); on small layers their fixed costs, not the
// arithmetic, set the time. Here g_y is pooled once into a channel-major
// grid of means (and the bias gradient from the same pass), each GEMM reads
// its operands where they lie, and g_x is spread straight from the
// channel-major product.
//
// `input_pooled` is the forward's patch sums of x (N x Ci x P x Q, ideally
// channel-major memory); it may be undefined when the weight gradient is
// not needed. Returns {g_x (N x Ci x H x W), g_W on the pooled kernel
// (Co x Ci/groups x 1 x 1), g_b (Co)}, each undefined unless asked for.
std::vector<torch::Tensor> collapsed_backward(
    const torch::Tensor& grad_output, const c10::optional<torch::Tensor>& input_pooled,
    const torch::Tensor& weight, int64_t groups, double scale,
    int64_t in_height, int64_t in_width, int64_t in_start_h, int64_t in_size_h,
    int64_t in_start_w, int64_t in_size_w, int64_t radius, bool need_input,
    bool need_weight, bool need_bias) {
  fused_backward_calls().fetch_add(1, std::memory_order_relaxed);
  check_input(grad_output, "grad_output");
  TORCH_CHECK(weight.scalar_type() == grad_output.scalar_type(),
              "weight and grad_output must have the same dtype");
  const int64_t N = grad_output.size(0), Co = grad_output.size(1);
  const int64_t ci_g = weight.size(1), co_g = Co / groups, Ci = ci_g * groups;
  TORCH_CHECK(weight.size(0) == Co && co_g * groups == Co,
              "weight does not match grad_output and groups");
  const int64_t count_h = (grad_output.size(2) + radius - 1) / radius;
  const int64_t count_w = (grad_output.size(3) + radius - 1) / radius;
  const int64_t cells = count_h * count_w;
  const Axis out_h = make_axis(grad_output.size(2), 0, radius, count_h);
  const Axis out_w = make_axis(grad_output.size(3), 0, radius, count_w);

  // Step 1 (Eq. 2): patch means of g_y, channel-major; plane totals -> g_b.
  auto means = empty_for_writing({Co, N * cells}, grad_output.options());
  torch::Tensor totals;
  if (need_bias) totals = torch::empty({N, Co}, grad_output.options());
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "filter_grad", [&] {
    PatchReduction<scalar_t> how;
    how.average = true;
    how.scale = static_cast<scalar_t>(scale);
    how.plane_totals = need_bias ? totals.data_ptr<scalar_t>() : nullptr;
    patch_sums_kernel<scalar_t, scalar_t>(
        grad_output.data_ptr<scalar_t>(), means.data_ptr<scalar_t>(), N * Co,
        out_h, out_w, cnhw_layout(N, Co, cells), how);
  });
  const auto by_group = [&](const torch::Tensor& t, int64_t per_group) {
    return t.view({groups, per_group, N * cells});
  };
  torch::Tensor grad_input, grad_kernel, grad_bias;
  if (need_bias) grad_bias = totals.sum(0);

  if (need_weight) {  // Step 4 (Eq. 5): g_W~ = g~ x~^T per group.
    TORCH_CHECK(input_pooled.has_value() && input_pooled->defined(),
                "the weight gradient needs the pooled input");
    const torch::Tensor& pooled = *input_pooled;
    TORCH_CHECK(pooled.scalar_type() == grad_output.scalar_type() &&
                    pooled.size(0) == N && pooled.size(1) == Ci &&
                    pooled.size(2) == count_h && pooled.size(3) == count_w,
                "pooled input does not match grad_output");
    const torch::Tensor channel_major = pooled.permute({1, 0, 2, 3}).contiguous();
    grad_kernel = grouped_matmul(by_group(means, co_g),
                                 by_group(channel_major, ci_g).transpose(1, 2))
                      .view({Co, ci_g, 1, 1});
  }

  if (need_input) {  // Steps 2 and 3 (Eq. 3): g_x~ = W~^T g~, spread over Q(P).
    const int64_t taps = weight.size(2) * weight.size(3);
    const torch::Tensor kernel =
        at::mv(weight.contiguous().view({Co * ci_g, taps}),
               at::ones({taps}, weight.options()))
            .view({groups, co_g, ci_g});
    const torch::Tensor mixed =
        grouped_matmul(kernel.transpose(1, 2), by_group(means, co_g));
    const Axis in_h = make_axis(in_height, in_start_h, in_size_h, count_h);
    const Axis in_w = make_axis(in_width, in_start_w, in_size_w, count_w);
    grad_input = empty_for_writing({N, Ci, in_height, in_width},
                                   grad_output.options());
    AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "spread", [&] {
      spread_kernel<scalar_t>(mixed.data_ptr<scalar_t>(),
                              grad_input.data_ptr<scalar_t>(), N * Ci, in_h, in_w,
                              cnhw_layout(N, Ci, cells));
    });
  }
  return {grad_input, grad_kernel, grad_bias};
}

namespace mmseg_gf {

// How a filtered conv convolves and where its input patches Q(P) lie (what
// the Python wrapper computes with AxisGeometry), kept in the autograd
// context as integers.
struct FilteredConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
  int64_t radius;
  int64_t start_h, size_h, start_w, size_w;  // input patches; count: the grid's

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
// and the engine's bridge to Python: on the Zen 4 VM we measured, right
// after a vanilla backward (cold caches, as in training), ~150 us of Python
// around the compiled call and ~110 us more in the engine, where a C++
// node such as torch's own conv costs ~65 us. On 14x14 layers that was 10%
// of the filtered backward (512x512@14x14 weight-only, r = 4: 1.40 ->
// 1.25 ms). This node runs the same compiled passes (patch_sums forward,
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

// F.conv2d(input, weight, bias, ...) whose backward is the fused gradient
// filter, for a contiguous NCHW CPU input of a kernel that collapses on both
// axes (the caller checks the geometry).
torch::Tensor filtered_conv2d(const torch::Tensor& input,
                              const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias,
                              std::vector<int64_t> stride,
                              std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups,
                              int64_t radius, int64_t start_h, int64_t size_h,
                              int64_t start_w, int64_t size_w) {
  check_input(input, "input");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() &&
                  (!has_bias || bias->scalar_type() == input.scalar_type()),
              "input, weight and bias must have the same dtype");
  TORCH_CHECK(radius >= 1, "radius must be >= 1");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "stride, padding and dilation must be pairs");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("patch_sums", &patch_sums, "sums over patches of an NCHW tensor");
  m.def("spread", &spread, "broadcast a patch grid over an NCHW map");
  m.def("recycle_limit", [](int64_t bytes) {
    return OutputRecycler::instance().set_limit(bytes);
  }, "set the byte limit of the output pool; returns the previous one");
  m.def("recycled_bytes", [] { return OutputRecycler::instance().held_bytes(); },
        "bytes of freed outputs kept for reuse");
  m.def("release_recycled", [] { OutputRecycler::instance().release(); },
        "free every kept output block");
  m.def("set_onednn_products", [](bool enabled) {
    return onednn_products().exchange(enabled);
  }, "let large float32 products run on oneDNN; returns the previous setting");
  m.def("onednn_products_preferred", &amd_cpu_with_full_width_avx512,
        "whether this CPU was measured to run them faster on oneDNN");
  m.def("filtered_conv2d", &mmseg_gf::filtered_conv2d,
        "conv2d whose backward is the fused gradient filter (C++ autograd node)");
  m.def("fused_backward_calls", [] { return fused_backward_calls().load(); },
        "how many backward calls took the fused compiled path");
  m.def("collapsed_backward", &collapsed_backward,
        "fused gradient-filter backward for kernels collapsed on both axes");
}
