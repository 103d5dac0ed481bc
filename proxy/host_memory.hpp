// Host memory for command rings and registered buffers. A CUDA build installs an allocator of pinned memory
// mapped into the GPUs' address space (so kernels can push commands straight into the rings, and the proxy
// can stage GPU data for providers without GPU memory support); otherwise page-aligned ordinary memory.
#pragma once
#include <cstddef>

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

}  // namespace uccl_ep
