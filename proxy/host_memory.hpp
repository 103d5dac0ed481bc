// Host memory for command rings and registered buffers. A CUDA build installs an allocator of pinned memory
// mapped into the GPUs' address space (so kernels can push commands straight into the rings, and the proxy
// can stage GPU data for providers without GPU memory support); otherwise page-aligned ordinary memory.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace uccl_ep {

struct HostAllocator {
  void* (*alloc)(size_t bytes);  // returns nullptr on failure
  void (*free)(void* p);
  const char* name;
};

// Replaces the allocator for memory allocated from now on (memory keeps the allocator that made it).
void set_host_allocator(const HostAllocator& allocator);
const char* host_allocator_name();

// Page-aligned host memory from the current allocator; freed with host_free.
void* host_alloc(size_t bytes);
void host_free(void* p);

// 64-bit counters in host_alloc'd memory, zeroed: what the proxies publish (messages released to a consumer,
// writes retired) lands where a GPU kernel can poll it too in a CUDA build (word() is a plain address).
class HostCounters {
 public:
  explicit HostCounters(size_t n) : n_(n) {
    void* p = host_alloc(sizeof(std::atomic<uint64_t>) * (n ? n : 1));
    if (!p) throw std::bad_alloc();
    words_ = static_cast<std::atomic<uint64_t>*>(p);
    for (size_t i = 0; i < n_; ++i) new (&words_[i]) std::atomic<uint64_t>(0);
  }
  ~HostCounters() { host_free(words_); }
  HostCounters(const HostCounters&) = delete;
  HostCounters& operator=(const HostCounters&) = delete;

  std::atomic<uint64_t>& operator[](size_t i) { return words_[i]; }
  const std::atomic<uint64_t>& operator[](size_t i) const { return words_[i]; }
  const uint64_t* word(size_t i) const { return reinterpret_cast<const uint64_t*>(&words_[i]); }

 private:
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
                "counters must be plain 64-bit words");
  size_t n_;
  std::atomic<uint64_t>* words_ = nullptr;
};

}  // namespace uccl_ep
