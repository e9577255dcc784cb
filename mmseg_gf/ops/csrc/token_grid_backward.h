// The gradient filter of a Linear on a token grid
// (docs/gradient_filter.md#linear-layers-on-token-grids): patch sums of
// channels-last token rows, and the whole filtered backward in one call.
//
// Tensors are seen as `(L, H, W, C)` token rows: L leading rows (images,
// windows, the batch of an (N, B, C) input), the H x W grid, channels last
// with stride 1; the other strides are free, so a view that skips extra
// tokens (a ViT's cls token) or transposes the batch is read in place.
// Patch P along an axis covers tokens [P*r, min((P+1)*r, extent)).

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace mmseg_gf {

// Sums of `rows` (L x H x W x C, channel stride 1, float32 / float64) over
// every r x r patch: a contiguous L x ceil(H/r) x ceil(W/r) x C tensor in
// rows' dtype, partial border patches summed over the tokens they have.
// One read of `rows`.
torch::Tensor token_patch_sums(const torch::Tensor& rows, int64_t radius);

// The filtered backward of the grid tokens, chunk by chunk of patch rows:
// the patch means of g_y (one read), then per chunk, while the means are in
// cache, g_x~ = means W (broadcast into every token of its patch of
// `grad_x_rows`, one write) and g_W += means^T x~.
//
// `grad_rows`: g_y's grid tokens, L x H x W x Co. `x_sums`: the forward's
// patch sums of x, contiguous L x Ph x Pw x Ci (needed for g_W).
// `grad_x_rows`: where g_x's grid tokens go, L x H x W x Ci (channel
// stride 1), or undefined. Returns {g_W (Co x Ci), g_b (Co)}, each
// undefined unless asked for; all tensors share one dtype.
//
// `chunk_bytes`: bytes of patch means and g_x~ per chunk (sized to stay in
// the L2 cache between the passes); a g_x of `stream_bytes` or more is
// written with non-temporal stores (it cannot stay in cache, and streaming
// stores skip reading each line before writing it).
std::vector<torch::Tensor> token_filtered_backward(
    const torch::Tensor& grad_rows, const c10::optional<torch::Tensor>& x_sums,
    const torch::Tensor& weight,
    const c10::optional<torch::Tensor>& grad_x_rows,
    int64_t radius, bool need_weight, bool need_bias, int64_t chunk_bytes,
    int64_t stream_bytes);

}  // namespace mmseg_gf
