// Softmax cross-entropy of bilinearly upsampled logits (or the sum of
// per-class binary cross-entropies on one-hot labels), with its gradient
// w.r.t. the low-resolution logits: the extension module
// mmseg_gf._resized_loss, wrapped by mmseg_gf/ops/resized_loss/loss.py.
//
// A segmentation loss upsamples N x C x h x w logits to the label's H x W
// and takes a per-pixel cross-entropy. Here the upsampled logits exist one
// output row at a time (C x W floats): each row is blended from two
// horizontally interpolated low-resolution rows (cached while consecutive
// output rows share them), its softmax, loss, top-1 hit and gradient are
// taken in place, and the gradient is blended back into two full-width
// accumulators, one per low-resolution row. When no later output row reads
// a low-resolution row any more, its accumulator is spread back over the
// row's w columns (the horizontal half of the upsampling's adjoint) into
// the low-resolution gradient. Everything a pixel needs is in cache; the
// inner loops run over contiguous W-long rows, so the compiler vectorises
// them (an AVX2+FMA copy is chosen at run time where an x86-64 CPU has it;
// elsewhere, e.g. on aarch64, the portable copy is NEON code at -O3).
//
// The interpolation's source indices and weights follow PyTorch's
// upsample_bilinear2d on the CPU (float arithmetic, same clamping), so the
// upsampled logits are PyTorch's up to the rounding of the blend.

#include <ATen/Parallel.h>
// torch/extension.h without the C++ frontend (nn, optim, ...): tensors
// and their pybind11 conversions parse in 60% of its time.
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Source indices and weights of bilinear interpolation along one axis.
struct AxisWeights {
  std::vector<int64_t> lo, hi;
  std::vector<float> w_lo, w_hi;
};

AxisWeights axis_weights(int64_t in, int64_t out, bool align_corners) {
  AxisWeights a;
  a.lo.resize(out);
  a.hi.resize(out);
  a.w_lo.resize(out);
  a.w_hi.resize(out);
  float scale;
  if (align_corners) {
    scale = out > 1 ? static_cast<float>(in - 1) / (out - 1) : 0.f;
  } else {
    scale = static_cast<float>(in) / out;
  }
  for (int64_t o = 0; o < out; ++o) {
    float src = align_corners ? scale * o : scale * (o + 0.5f) - 0.5f;
    if (!align_corners && src < 0.f) src = 0.f;
    const int64_t i =
        std::min<int64_t>(static_cast<int64_t>(std::floor(src)), in - 1);
    const float lambda = std::min(std::max(src - i, 0.f), 1.f);
    a.lo[o] = i;
    a.hi[o] = i + (i < in - 1 ? 1 : 0);
    a.w_lo[o] = 1.f - lambda;
    a.w_hi[o] = lambda;
  }
  return a;
}

// exp(x) for x <= 0 (a logit minus its pixel's maximum): Cody-Waite range
// reduction and Cephes' degree-6 polynomial, relative error ~1e-7; branch
// free so that the loop over a row vectorises (the file is compiled with
// -fno-trapping-math, without which GCC keeps the clamp's branch).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

// row <- exp(row - top), sum += row, over one W-long row.
__attribute__((always_inline)) inline void exp_row(float* __restrict row,
                                                   const float* __restrict top,
                                                   float* __restrict sum,
                                                   int64_t W) {
  for (int64_t X = 0; X < W; ++X) {
    const float e = exp_nonpositive(row[X] - top[X]);
    row[X] = e;
    sum[X] += e;
  }
}

// log(u) for u in [1, 2] (u = 1 + exp(-|z|) of a softplus): Cephes'
// polynomial after halving u above sqrt(2); branch free.
__attribute__((always_inline)) inline float log_1_to_2(float u) {
  const bool big = u > 1.41421356f;
  const float k = big ? 1.f : 0.f;
  const float x = (big ? u * 0.5f : u) - 1.f;
  const float z = x * x;
  float y = 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * z - 2.12194440e-4f * k - 0.5f * z;
  return x + y + 0.693359375f * k;
}

// loss += softplus(row) (the binary cross-entropy of a negative label),
// row <- sigmoid(row), over one W-long row.
__attribute__((always_inline)) inline void softplus_row(
    float* __restrict row, float* __restrict loss, int64_t W) {
  for (int64_t X = 0; X < W; ++X) {
    const float z = row[X];
    const float e = exp_nonpositive(z < 0.f ? z : -z);
    const float inv = 1.f / (1.f + e);
    loss[X] += (z > 0.f ? z : 0.f) + log_1_to_2(1.f + e);
    row[X] = z >= 0.f ? inv : e * inv;
  }
}

// One image's problem: pointers into the batch and the settings.
struct Image {
  const float* logits;   // C x h x w
  const int64_t* label;  // H x W
  const float* weight;   // H x W, or null (weight 1)
  float* grad;           // C x h x w (zeros), or null
  float* pixel_loss;     // H x W, or null
  float* target_prob;    // H x W, or null (softmax only)
  int64_t classes, h, w, H, W, ignore_index;
  bool sigmoid;          // per-class binary cross-entropy, one-hot labels
};

struct ImageResult {
  double loss = 0.0;
  int64_t hits = 0;
  bool bad_label = false;
};

// Two C x W row buffers keyed by the low-resolution row they hold.
struct RowPair {
  int64_t row[2] = {-1, -1};
  float* buf[2] = {nullptr, nullptr};

  int find(int64_t r) const { return row[0] == r ? 0 : (row[1] == r ? 1 : -1); }
  // The slot to reuse for a row while rows a and b are needed.
  int victim(int64_t a, int64_t b) const {
    return (row[0] != a && row[0] != b) ? 0 : 1;
  }
};

__attribute__((always_inline)) inline void interpolate_row(
    const Image& im, const AxisWeights& ax, int64_t r, float* out) {
  const int64_t W = im.W;
  const int64_t* lo = ax.lo.data();
  const int64_t* hi = ax.hi.data();
  const float* w_lo = ax.w_lo.data();
  const float* w_hi = ax.w_hi.data();
  for (int64_t c = 0; c < im.classes; ++c) {
    const float* src = im.logits + (c * im.h + r) * im.w;
    float* dst = out + c * W;
    for (int64_t X = 0; X < W; ++X) {
      dst[X] = w_lo[X] * src[lo[X]] + w_hi[X] * src[hi[X]];
    }
  }
}

// The horizontal half of the adjoint: a full-width gradient row of
// low-resolution row r spread back over its w columns.
__attribute__((always_inline)) inline void flush_row(
    const Image& im, const AxisWeights& ax, int64_t r, const float* acc) {
  const int64_t* lo = ax.lo.data();
  const int64_t* hi = ax.hi.data();
  const float* w_lo = ax.w_lo.data();
  const float* w_hi = ax.w_hi.data();
  for (int64_t c = 0; c < im.classes; ++c) {
    float* dst = im.grad + (c * im.h + r) * im.w;
    const float* a = acc + c * im.W;
    for (int64_t X = 0; X < im.W; ++X) {
      dst[lo[X]] += w_lo[X] * a[X];
      dst[hi[X]] += w_hi[X] * a[X];
    }
  }
}

__attribute__((always_inline)) inline ImageResult image_loss_impl(
    const Image& im, const AxisWeights& ay, const AxisWeights& ax) {
  const int64_t C = im.classes, W = im.W;
  const size_t plane = static_cast<size_t>(C * W);
  std::vector<float> store(plane * (im.grad ? 5 : 3) + 5 * W);
  float* rows = store.data();                 // the interpolated rows
  float* logit = rows + 2 * plane;            // one output row, C x W
  float* accs = logit + plane;                // gradient accumulators
  float* top = store.data() + store.size() - 5 * W;
  float* sum = top + W;
  float* label_logit = sum + W;
  float* wt = label_logit + W;
  float* ce = wt + W;
  std::vector<int32_t> best(W), label(W);
  RowPair cached, acc;
  cached.buf[0] = rows;
  cached.buf[1] = rows + plane;
  if (im.grad) {
    acc.buf[0] = accs;
    acc.buf[1] = accs + plane;
  }
  ImageResult result;
  for (int64_t Y = 0; Y < im.H; ++Y) {
    const int64_t y0 = ay.lo[Y], y1 = ay.hi[Y];
    const float v0 = ay.w_lo[Y], v1 = ay.w_hi[Y];
    for (int64_t r : {y0, y1}) {
      if (cached.find(r) < 0) {
        const int k = cached.victim(y0, y1);
        cached.row[k] = r;
        interpolate_row(im, ax, r, cached.buf[k]);
      }
    }
    const float* a = cached.buf[cached.find(y0)];
    const float* b = cached.buf[cached.find(y1)];
    for (size_t i = 0; i < plane; ++i) logit[i] = v0 * a[i] + v1 * b[i];

    const int64_t* lab = im.label + Y * W;
    bool any_weight = false;
    for (int64_t X = 0; X < W; ++X) {
      const int64_t t = lab[X];
      const bool valid = t != im.ignore_index;
      if (valid && (t < 0 || t >= C)) result.bad_label = true;
      const bool usable = valid && t >= 0 && t < C;
      label[X] = usable ? static_cast<int32_t>(t) : 0;
      wt[X] = usable ? (im.weight ? im.weight[Y * W + X] : 1.f) : 0.f;
      any_weight = any_weight || wt[X] != 0.f;
      label_logit[X] = logit[label[X] * W + X];
    }
    std::memcpy(top, logit, W * sizeof(float));
    std::fill(best.begin(), best.end(), 0);
    for (int64_t c = 1; c < C; ++c) {
      const float* row = logit + c * W;
      for (int64_t X = 0; X < W; ++X) {
        // NaN counts as above: the pixel's loss is then NaN, as PyTorch's.
        const bool above = !(row[X] <= top[X]);
        top[X] = above ? row[X] : top[X];
        best[X] = above ? static_cast<int32_t>(c) : best[X];
      }
    }
    // Per-pixel losses; `logit` becomes the softmax numerators (or the
    // sigmoids), `sum` their sum (1 for sigmoid: no normalisation).
    if (im.sigmoid) {
      std::fill(ce, ce + W, 0.f);
      for (int64_t c = 0; c < C; ++c) softplus_row(logit + c * W, ce, W);
      for (int64_t X = 0; X < W; ++X) ce[X] -= label_logit[X];
      std::fill(sum, sum + W, 1.f);
    } else {
      std::fill(sum, sum + W, 0.f);
      for (int64_t c = 0; c < C; ++c) exp_row(logit + c * W, top, sum, W);
      for (int64_t X = 0; X < W; ++X) {
        ce[X] = std::log(sum[X]) + top[X] - label_logit[X];
      }
    }
    double row_loss = 0.0;
    for (int64_t X = 0; X < W; ++X) {
      const bool valid = lab[X] != im.ignore_index;
      row_loss += static_cast<double>(wt[X]) * (valid ? ce[X] : 0.f);
      result.hits += (valid && best[X] == label[X]) ? 1 : 0;
      if (im.pixel_loss) im.pixel_loss[Y * W + X] = valid ? ce[X] : 0.f;
      if (im.target_prob) {
        im.target_prob[Y * W + X] =
            valid ? logit[label[X] * W + X] / sum[X] : 0.f;
      }
    }
    result.loss += row_loss;
    if (!im.grad) continue;

    // Accumulators of rows y0 and y1; a row no output row reads any more
    // is spread back first.
    for (int64_t r : {y0, y1}) {
      if (acc.find(r) < 0) {
        const int k = acc.victim(y0, y1);
        if (acc.row[k] >= 0) flush_row(im, ax, acc.row[k], acc.buf[k]);
        acc.row[k] = r;
        std::fill(acc.buf[k], acc.buf[k] + plane, 0.f);
      }
    }
    if (!any_weight) continue;
    for (int64_t X = 0; X < W; ++X) sum[X] = wt[X] / sum[X];
    for (int64_t c = 0; c < C; ++c) {
      float* row = logit + c * W;
      for (int64_t X = 0; X < W; ++X) row[X] *= sum[X];
    }
    for (int64_t X = 0; X < W; ++X) logit[label[X] * W + X] -= wt[X];
    float* g0 = acc.buf[acc.find(y0)];
    float* g1 = acc.buf[acc.find(y1)];
    if (y0 == y1) {
      const float v = v0 + v1;
      for (size_t i = 0; i < plane; ++i) g0[i] += v * logit[i];
    } else {
      for (size_t i = 0; i < plane; ++i) {
        g0[i] += v0 * logit[i];
        g1[i] += v1 * logit[i];
      }
    }
  }
  if (im.grad) {
    for (int k = 0; k < 2; ++k) {
      if (acc.row[k] >= 0) flush_row(im, ax, acc.row[k], acc.buf[k]);
    }
  }
  return result;
}

ImageResult image_loss_generic(const Image& im, const AxisWeights& ay,
                               const AxisWeights& ax) {
  return image_loss_impl(im, ay, ax);
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) ImageResult image_loss_avx2(
    const Image& im, const AxisWeights& ay, const AxisWeights& ax) {
  return image_loss_impl(im, ay, ax);
}

bool has_avx2_fma() {
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

ImageResult image_loss(const Image& im, const AxisWeights& ay,
                       const AxisWeights& ax) {
  return has_avx2_fma() ? image_loss_avx2(im, ay, ax)
                        : image_loss_generic(im, ay, ax);
}
#else  // no run-time choice: the portable copy, vectorised for the target
ImageResult image_loss(const Image& im, const AxisWeights& ay,
                       const AxisWeights& ax) {
  return image_loss_generic(im, ay, ax);
}
#endif

std::vector<torch::Tensor> resized_cross_entropy(
    const torch::Tensor& logits, const torch::Tensor& label,
    const c10::optional<torch::Tensor>& weight, int64_t ignore_index,
    bool align_corners, bool want_grad, bool want_pixels, bool sigmoid) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 4 && logits.is_contiguous(),
              "logits must be a contiguous N x C x h x w float32 CPU tensor");
  TORCH_CHECK(label.device().is_cpu() && label.scalar_type() == at::kLong &&
                  label.dim() == 3 && label.is_contiguous() &&
                  label.size(0) == logits.size(0),
              "label must be a contiguous N x H x W int64 CPU tensor with the "
              "logits' N");
  const bool weighted = weight.has_value() && weight->defined();
  if (weighted) {
    TORCH_CHECK(weight->device().is_cpu() &&
                    weight->scalar_type() == at::kFloat &&
                    weight->is_contiguous() &&
                    weight->sizes() == label.sizes(),
                "weight must be a contiguous float32 tensor of the label's "
                "shape");
  }
  const int64_t N = logits.size(0), C = logits.size(1), h = logits.size(2),
                w = logits.size(3), H = label.size(1), W = label.size(2);
  TORCH_CHECK(C > 0 && h > 0 && w > 0 && H > 0 && W > 0,
              "logits and label must not be empty");
  auto loss = torch::zeros({N}, logits.options().dtype(at::kDouble));
  auto hits = torch::zeros({N}, logits.options().dtype(at::kLong));
  auto grad = want_grad ? torch::zeros_like(logits) : torch::Tensor();
  auto pixel_loss = want_pixels ? torch::empty({N, H, W}, logits.options())
                                : torch::Tensor();
  auto target_prob = want_pixels && !sigmoid
                         ? torch::empty({N, H, W}, logits.options())
                         : torch::Tensor();
  const AxisWeights ay = axis_weights(h, H, align_corners);
  const AxisWeights ax = axis_weights(w, W, align_corners);
  std::atomic<bool> bad_label{false};
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      Image im{logits.data_ptr<float>() + n * C * h * w,
               label.data_ptr<int64_t>() + n * H * W,
               weighted ? weight->data_ptr<float>() + n * H * W : nullptr,
               want_grad ? grad.data_ptr<float>() + n * C * h * w : nullptr,
               want_pixels ? pixel_loss.data_ptr<float>() + n * H * W
                           : nullptr,
               want_pixels && !sigmoid
                   ? target_prob.data_ptr<float>() + n * H * W
                   : nullptr,
               C, h, w, H, W, ignore_index, sigmoid};
      const ImageResult r = image_loss(im, ay, ax);
      loss.data_ptr<double>()[n] = r.loss;
      hits.data_ptr<int64_t>()[n] = r.hits;
      if (r.bad_label) bad_label = true;
    }
  });
  TORCH_CHECK(!bad_label, "labels must lie in [0, ", C,
              ") or be ignore_index=", ignore_index);
  return {loss, hits, grad, pixel_loss, target_prob};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("resized_cross_entropy", &resized_cross_entropy,
        "softmax (or per-class sigmoid) cross-entropy of bilinearly "
        "upsampled logits: per-image weighted loss, top-1 hits, the "
        "low-resolution gradient and per-pixel maps");
}
