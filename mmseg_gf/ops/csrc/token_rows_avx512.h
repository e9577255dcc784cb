// The two full-size passes of the filtered Linear's backward over float32
// token rows, and its weight-gradient product, written with AVX-512
// intrinsics (token_grid_backward.cpp calls them where the CPU has
// AVX-512F, the product only where products may leave MKL; the extension
// itself is built for baseline x86-64).
//
// Why not the portable loops: those add one token row of a patch row into
// its cells, then the next token row, so every cell is loaded and stored r
// times, and at C >= 128 channels the cells (Pw x C floats) no longer stay
// in L1 next to the streaming token rows; they pooled g_y at 13-22 GB/s,
// a third to a half of one plain read (float32, 8 x 128 x 128 tokens, one
// Zen 5 core). Here a patch's r x r tokens are summed in a register, 16
// channels at a time, with r token rows streaming side by side: the sums
// (same additions, same order, so the same bits as the portable loops)
// cost about one read of g_y. The spread writes each patch's vector
// straight into its tokens, row by row, instead of expanding a first token
// row and copying it.
//
// Token (h, w) of a patch row sits at `first + (h - h0) * sh + w * sw`
// (element strides; channels stride 1).

#pragma once

#include <cstdint>

namespace mmseg_gf {

// Whether this build and CPU run the functions below (x86-64, GCC or Clang,
// AVX-512F at run time) and they are not switched off.
bool token_rows_avx512_enabled();

// Switches the functions below off (false) or back on; returns the previous
// setting. For tests that compare them with the portable loops.
bool set_token_rows_avx512(bool enabled);

// The cells of one patch row: `rows` token rows (r, or fewer at the bottom
// border) of W tokens, patches of r tokens along W (the last one partial).
// out[q * C + c] = the sum of patch q's tokens, times 1 / (its token count)
// where `means`; `part` (C floats, or null) += the sums (a bias share).
void pool_patch_row_avx512(const float* first, int64_t sh, int64_t sw,
                           int64_t W, int64_t r, int64_t rows, int64_t C,
                           bool means, float* out, float* part);

// Every token of one patch row (`rows` token rows of W tokens from `first`)
// = its patch's C-vector of `cells` (Pw x C, contiguous); `stream`:
// non-temporal stores where every store is 64-byte aligned.
void spread_patch_row_avx512(const float* cells, float* first, int64_t sh,
                             int64_t sw, int64_t W, int64_t r, int64_t rows,
                             int64_t C, bool stream);

// c (rows x Ci, contiguous) += a^T b for a (n x rows, row stride lda) and
// b (n x Ci, contiguous): the weight gradient of a chunk of patch cells
// (means^T x~), or `rows` of its rows.
// Each 8 x 32 block of c is summed over the n rows in 16 registers, one
// fused multiply-add per row and 16 outputs; about 250 GFLOP/s on one Zen 5
// core for the chunks of the layer benchmark, against MKL's ~100 (AVX2 on
// AMD CPUs). The sums run over the rows in order, in float32 (MKL's order
// differs: the same products to float32 rounding).
void add_transposed_product_avx512(const float* a, int64_t lda,
                                   const float* b, float* c, int64_t n,
                                   int64_t rows, int64_t Ci);

}  // namespace mmseg_gf
