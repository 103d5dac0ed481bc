// libfabric transport: one domain and registered buffer per local device, one RDM endpoint (with its own
// completion queue and address vector) per channel. Knows nothing of rings or ordering.
#pragma once
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace uccl_ep {

// What a peer needs to write into this device's buffer: endpoint names and the memory key.
struct EndpointInfo {
  uint32_t rank = 0;
  uint64_t remote_base = 0;  // address to add offsets to (the buffer's address under FI_MR_VIRT_ADDR, else 0)
  uint64_t key = 0;
  std::string host;
  int64_t pid = -1;                         // the process, for telling a peer on this host is gone
  std::vector<std::vector<uint8_t>> names;  // one per channel

  std::vector<uint8_t> serialize() const;
  static EndpointInfo deserialize(const std::vector<uint8_t>& bytes);
};

struct Completion {
  bool remote_data;  // an incoming write carrying an immediate
  uint32_t imm;      // valid when remote_data
  void* context;     // our context for local completions
};

// libfabric's shm provider names its segments /dev/shm/<pid>:<domain>:<endpoint>. A process killed before it
// closed its endpoints leaves them behind, and a later process that gets the same pid then fails in fi_enable
// (EBUSY). Call before this process opens any endpoint: segments named after our own pid are stale then.
void remove_stale_shm_segments();
// The same for a peer killed mid-job (its owner never closes them): after this process closed its own endpoints,
// unlink the segments of `peer_names` (shm endpoint names, "fi_shm://<pid>:<domain>:<endpoint>") whose process is
// gone (no such pid, or a zombie). Live peers' segments are left alone (a peer in another pid namespace looks gone:
// its name goes too, which only stops new connections to it; this runs at shutdown, when none is made).
void remove_dead_peers_shm_segments(const std::vector<std::string>& peer_names);

class FabricDevice {
 public:
  // Tries each provider of `providers` (comma-separated, e.g. "shm,tcp;ofi_rxm") in order.
  FabricDevice(const std::string& providers, uint32_t rank, void* buffer, size_t bytes, int num_channels);
  ~FabricDevice();
  FabricDevice(const FabricDevice&) = delete;
  FabricDevice& operator=(const FabricDevice&) = delete;

  const std::string& provider() const { return provider_; }
  EndpointInfo local_info() const;
  static std::string host_name();                        // as local_info() gives it
  void connect(const std::vector<EndpointInfo>& peers);  // indexed by rank
  // shm: the peers' endpoint names (for remove_dead_peers_shm_segments); empty for other providers.
  const std::vector<std::string>& peer_shm_names() const { return peer_shm_names_; }
  // Peers on this host whose process has exited since connect() (ascending ranks), whatever the provider.
  std::vector<uint32_t> exited_local_peers() const;

  // Posts one write with an immediate; returns false if the provider asks to retry later (-FI_EAGAIN).
  bool post_write(int channel, uint32_t peer, uint64_t local_offset, uint64_t remote_offset, size_t length,
                  uint32_t imm, void* context);
  // Reads up to `max` completions of `channel`; error completions come back with their message in `error`
  // and the context of the failed operation.
  int poll(int channel, Completion* out, int max, std::string* error, void** error_context);

 private:
  struct Channel {
    fid_ep* ep = nullptr;
    fid_cq* cq = nullptr;
    fid_av* av = nullptr;
    std::vector<fi_addr_t> peer_addr;
  };
  std::string provider_;
  std::vector<std::string> peer_shm_names_;
  std::vector<std::pair<uint32_t, long>> local_peer_pids_;  // (rank, pid): peers on this host, running at connect()
  uint32_t rank_;
  char* buffer_;
  size_t bytes_;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_mr* mr_ = nullptr;
  void* mr_desc_ = nullptr;
  bool virt_addr_ = false;
  std::vector<Channel> channels_;
  std::vector<uint64_t> peer_base_;
  std::vector<uint64_t> peer_key_;
};

}  // namespace uccl_ep
