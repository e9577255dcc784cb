// Output recycling (see output_recycler.h).

#include "output_recycler.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/util/safe_numerics.h>

namespace mmseg_gf {
namespace {

// Fresh memory for a large tensor that a pass writes in full.
//
// With 4 KiB pages the first write to every page of new memory is a page
// fault, and faulting in a large output costs several times as much as
// writing it (a 78 MB g_x: about 23 ms of faults for 7 ms of writing).
// Advising transparent huge pages (Linux "madvise" mode, the usual default)
// for the 2 MiB-aligned part before the first write cuts the faults
// 512-fold. torch's own switch for this, THP_MEM_ALLOC_ENABLE=1,
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
// Fresh memory stays expensive even with huge pages on virtual machines
// whose host takes back free guest memory (free page reporting): a 78 MB
// spread takes about 6 ms while its huge pages are still backed by the host
// and 86-97 ms when they must be backed again, which happens often right
// after a vanilla backward has freed as much. Training calls the same
// layers with the same shapes every step, so a block freed by one step fits
// the next one exactly: as torch's CUDA allocator does on GPUs,
// blocks of kRecycleBytes or more go back to a small pool when their tensor
// dies and are lent out again for the same byte size. That bound is glibc's
// default mmap threshold: smaller blocks come from malloc's heap, which
// reuses memory already; larger ones are fresh mappings, whose page faults
// cost the small layers too (the 6.4 MB g_x of a 64x64@56x56 layer at
// r = 2, right after a vanilla backward: 4.4 ms with an 8 MiB bound, 2.5 ms
// with this one; weight-only calls, with their sub-MiB grids, are the same
// either way).
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

}  // namespace

torch::Tensor empty_for_writing(at::IntArrayRef sizes,
                                const at::TensorOptions& options) {
  int64_t elements = 1;
  for (const int64_t size : sizes) {
    TORCH_CHECK(size >= 0, "empty_for_writing: sizes must be >= 0, got ",
                sizes);
    TORCH_CHECK(!c10::mul_overflows(elements, size, &elements),
                "empty_for_writing: ", sizes, " elements overflow int64");
  }
  int64_t bytes = 0;
  TORCH_CHECK(!c10::mul_overflows(
                  elements, static_cast<int64_t>(options.dtype().itemsize()),
                  &bytes),
              "empty_for_writing: ", sizes, " x ", options.dtype().itemsize(),
              " bytes overflow int64");
  return OutputRecycler::instance().empty(sizes, options);
}

int64_t set_recycle_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "recycle limit must be >= 0 bytes, got ", bytes);
  return OutputRecycler::instance().set_limit(bytes);
}

int64_t recycled_bytes() { return OutputRecycler::instance().held_bytes(); }

void release_recycled() { OutputRecycler::instance().release(); }

}  // namespace mmseg_gf
