// The backward of a bilinear resize, separably (see bilinear_backward.cpp).
#pragma once

#include <torch/types.h>

namespace mmseg_gf {

// torch's upsample_bilinear2d_backward of `grad` (N x C x Ho x Wo, each
// image contiguous: a channel slice of a batch qualifies), written into
// `out` (N x C x Hi x Wi, contiguous, overwritten). `scale_h` / `scale_w`
// as torch's kernel takes them (<= 0: none, the sizes' ratio).
void bilinear_backward(const at::Tensor& grad, at::Tensor& out,
                       bool align_corners, double scale_h, double scale_w);

}  // namespace mmseg_gf
