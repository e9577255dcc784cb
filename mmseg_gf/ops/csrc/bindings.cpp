// Python bindings of the CPU kernels: the extension module
// mmseg_gf._patch_ops, wrapped by the operators' cpu.py modules (mmseg_gf/ops/*/cpu.py).
//
// What the other files hold, from the bottom up: patch_kernels (the two
// passes over full-size tensors: pooling and spreading), output_recycler
// (memory of large outputs kept from one step for the next),
// bilinear_backward (a resize's backward, one axis at a time), cpu_dispatch
// (MKL or oneDNN for the fused backward's products), collapsed_backward
// (the whole backward of the usual conv in one call) and
// filtered_conv_node (that conv as a C++ autograd node); token_grid_backward
// (the filtered backward of a Linear on a token grid) and token_rows_avx512
// (its full-size passes over float32 tokens with AVX-512).

// torch/extension.h without the C++ frontend (nn, optim, ...): tensors
// and their pybind11 conversions parse in 60% of its time.
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include "bilinear_backward.h"
#include "collapsed_backward.h"
#include "cpu_dispatch.h"
#include "filtered_conv_node.h"
#include "output_recycler.h"
#include "patch_kernels.h"
#include "token_grid_backward.h"
#include "token_rows_avx512.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace gf = mmseg_gf;
  m.def("patch_sums", &gf::patch_sums, "sums over patches of an NCHW tensor");
  m.def("spread", &gf::spread, "broadcast a patch grid over an NCHW map");
  m.def("recycle_limit", &gf::set_recycle_limit,
        "set the byte limit of the output pool; returns the previous one");
  m.def("recycled_bytes", &gf::recycled_bytes,
        "bytes of freed outputs kept for reuse");
  m.def("release_recycled", &gf::release_recycled,
        "free every kept output block");
  m.def("bilinear_backward", &gf::bilinear_backward,
        "the backward of a bilinear resize into `out`, one axis at a time");
  m.def(
      "empty_for_writing",
      [](std::vector<int64_t> sizes, at::ScalarType dtype) {
        return gf::empty_for_writing(sizes, at::TensorOptions().dtype(dtype));
      },
      "an uninitialised contiguous CPU tensor, a recycled block when one of "
      "its byte size is kept");
  m.def("set_onednn_products", &gf::set_onednn_products,
        "let large float32 products run on oneDNN; returns the previous "
        "setting");
  m.def("onednn_products_preferred", &gf::amd_cpu_with_full_width_avx512,
        "whether this CPU runs them on oneDNN by default (AMD with "
        "full-width AVX-512)");
  m.def("filtered_conv2d", &gf::filtered_conv2d,
        "conv2d whose backward is the fused gradient filter (C++ autograd "
        "node)");
  m.def("fused_backward_calls", &gf::fused_backward_calls,
        "how many backward calls took the fused compiled path");
  m.def("collapsed_backward", &gf::collapsed_backward,
        "fused gradient-filter backward for kernels collapsed on both axes");
  m.def("token_patch_sums", &gf::token_patch_sums,
        "sums of L x H x W x C token rows over r x r patches");
  m.def("token_filtered_backward", &gf::token_filtered_backward,
        "gradient-filter backward of a Linear on token rows: {g_W, g_b}, "
        "g_x written into grad_x_rows");
  m.def("token_rows_avx512_enabled", &gf::token_rows_avx512_enabled,
        "whether the token-grid kernels pass over float32 rows with "
        "AVX-512");
  m.def("set_token_rows_avx512", &gf::set_token_rows_avx512,
        "switch the AVX-512 token-row passes off (false) or on; returns the "
        "previous setting");
}
