// Output recycling: memory for the large tensors the kernels write in full
// (g_x, patch grids, the pooled weight gradient), kept from one backward for
// the next. See output_recycler.cpp for the rule and the reason.

#pragma once

#include <torch/types.h>

#include <cstdint>

namespace mmseg_gf {

// A tensor for a pass that writes all of it once (g_x, patch grids): a
// recycled block of the same byte size if one is held, else fresh memory.
torch::Tensor empty_for_writing(at::IntArrayRef sizes,
                                const at::TensorOptions& options);

// Sets how many bytes of freed outputs are kept (freeing blocks above it);
// returns the previous limit.
int64_t set_recycle_limit(int64_t bytes);

// Bytes of freed outputs kept for reuse right now.
int64_t recycled_bytes();

// Frees every kept block (as torch.cuda.empty_cache does on GPUs).
void release_recycled();

}  // namespace mmseg_gf
