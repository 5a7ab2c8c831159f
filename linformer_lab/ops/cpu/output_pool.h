// Large output buffers that a kernel module keeps after their tensors die, to hand out again.
//
// Why: torch's CPU allocator has no cache. glibc serves every allocation of 32 MiB and more from
// fresh mmap pages, and returns freed memory at the top of its heap to the system once it passes
// a threshold, so a kernel's large outputs pay a page fault per 4 KiB they write, call after call.
// At the largest shapes those faults took longer than the arithmetic of a forward + backward, and
// pooling from 4 MiB rather than 32 paid at mid-sized ones too. A training loop asks for the same
// sizes at every step, so reused buffers fault once per process.
//
// Buffers below kPooledBytes come from torch. Larger ones are whole 2 MiB pages, marked for
// transparent huge pages on Linux (a hint), and go back to the pool when their tensor's storage is
// freed, while the pool holds at most its limit ($LINFORMER_LAB_CPU_POOL_MIB, default 1024; 0: no
// pool); past that, the oldest free ones go back to the system. A request takes a free buffer of
// exactly its rounded size. Each module (kernel) has its own pool (internal linkage), which
// set_limit(0) empties.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

class OutputPool {
 public:
  static constexpr int64_t kPooledBytes = int64_t{4} << 20, kPage = int64_t{2} << 20;

  // The one pool of this module; never destroyed, as tensors may free buffers during exit.
  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();
    return *pool;
  }

  // An uninitialised contiguous tensor of these sizes.
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    int64_t bytes = static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
    for (int64_t s : sizes) bytes *= s;
    if (bytes < kPooledBytes || limit() == 0) return at::empty(sizes, options);
    const int64_t capacity = (bytes + kPage - 1) / kPage * kPage;
    void* data = take(capacity);
    if (data == nullptr) data = fresh(capacity);
    return at::from_blob(data, sizes, [capacity](void* p) { OutputPool::get().give(p, capacity); }, options);
  }

  int64_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  // Sets the most bytes kept free (0: none, and the free ones go back to the system); returns the old limit.
  int64_t set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t before = limit_;
    limit_ = std::max<int64_t>(bytes, 0);
    while (held_ > limit_) release(0);
    return before;
  }

  // (bytes held free, buffers handed out again, buffers made fresh): for tests and benchmarks.
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {held_, reused_, made_};
  }

 private:
  OutputPool() {
    const char* env = std::getenv("LINFORMER_LAB_CPU_POOL_MIB");
    limit_ = (env != nullptr && *env != '\0' ? std::max<int64_t>(std::atoll(env), 0) : 1024) << 20;
  }

  void* take(int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = free_.size(); i-- > 0;) {  // the most recently freed first: likeliest in cache
      if (free_[i].second == capacity) {
        void* data = free_[i].first;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        held_ -= capacity, ++reused_;
        return data;
      }
    }
    return nullptr;
  }

  void* fresh(int64_t capacity) {
    void* data = std::aligned_alloc(kPage, static_cast<size_t>(capacity));
    if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data, static_cast<size_t>(capacity), MADV_HUGEPAGE);  // a hint: errors ignored
#endif
    std::lock_guard<std::mutex> lock(mutex_);
    ++made_;
    return data;
  }

  void give(void* data, int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    // past the limit, the oldest free buffers go first: the next call most likely asks for this one
    while (held_ + capacity > limit_ && !free_.empty()) release(0);
    if (held_ + capacity > limit_) {
      std::free(data);
      return;
    }
    free_.emplace_back(data, capacity);
    held_ += capacity;
  }

  void release(size_t i) {
    std::free(free_[i].first);
    held_ -= free_[i].second;
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  std::mutex mutex_;
  std::vector<std::pair<void*, int64_t>> free_;  // (buffer, capacity), oldest first
  int64_t limit_ = 0, held_ = 0, reused_ = 0, made_ = 0;
};

}  // namespace
