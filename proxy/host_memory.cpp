#include "host_memory.hpp"

#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>

namespace uccl_ep {
namespace {

void* aligned(size_t bytes) {
  const size_t page = 4096;
  return std::aligned_alloc(page, (bytes + page - 1) / page * page);
}

std::mutex mutex;
HostAllocator current{aligned, std::free, "page-aligned"};
std::unordered_map<void*, void (*)(void*)> owners;  // who frees each block

}  // namespace

void set_host_allocator(const HostAllocator& allocator) {
  std::lock_guard<std::mutex> lock(mutex);
  current = allocator;
}

const char* host_allocator_name() {
  std::lock_guard<std::mutex> lock(mutex);
  return current.name;
}

void* host_alloc(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  void* p = current.alloc(bytes);
  if (!p && current.alloc != aligned) {  // e.g. pinned memory refused: ordinary memory still works
    p = aligned(bytes);
    if (p) owners[p] = std::free;
  } else if (p) {
    owners[p] = current.free;
  }
  if (!p) throw std::bad_alloc();
  return p;
}

void host_free(void* p) {
  if (!p) return;
  void (*free_fn)(void*) = std::free;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = owners.find(p);
    if (it != owners.end()) {
      free_fn = it->second;
      owners.erase(it);
    }
  }
  free_fn(p);
}

}  // namespace uccl_ep
