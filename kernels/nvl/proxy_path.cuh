// The proxy path's shared parts (GPUs on several nodes, GPU-initiated ops): how a kernel pushes a whole message
// per member into channel 0's command ring, how a receive is acknowledged, and the host side of an op's halves
// (ProxyHalf). Used by the low-latency ops (low_latency.cu) and normal mode (normal_proxy.cu).
#pragma once
#include <any>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../proxy/runtime.hpp"
#include "../pending_half.hpp"
#include "api.hpp"
#include "device_common.cuh"
#include "ring_producer.cuh"

namespace uccl_ep::nvl {

// Per GPU (by CUDA device): the word the proxy path's kernels report errors into (mapped host memory, read after
// each call) and the send blocks' counter that finds the last block.
struct ProxyGpu {
  DeviceErrors* errors_host = nullptr;
  DeviceErrors* errors_device = nullptr;
  unsigned int* done = nullptr;
  // Normal mode: a message lands whole before its receiver reads it (the proxy releases it once every write did),
  // so the progress words lose their use. The send kernel announces into `sink` ([1 + kChunks], device), the
  // receive kernel reads `landed` ([kChunks], device: every chunk of message 1 complete).
  uint64_t* sink = nullptr;
  const uint64_t* landed = nullptr;
  void* scratch = nullptr;  // normal mode's (normal_proxy.cu), grown as needed
  size_t scratch_bytes = 0;
};
// The GPU's state above, made on first use (low_latency.cu).
ProxyGpu& proxy_gpu(int cuda_device);

namespace {

// Across nodes (the proxy path): the send kernel's last block pushes one message per receiver into channel 0's
// command ring (a write per used piece of the region, then the fence), after the receiver acknowledged our
// previous message; the proxy posts them. Over NVLink `ring.slots` is null.
struct ProxyOut {
  DeviceRing ring;
  const uint64_t* ack[kMaxLowLatencyRanks];    // member d's released-message word (channel 0), or null: none awaited
  uint64_t ack_want[kMaxLowLatencyRanks];      // the count that means d read our previous message
  uint64_t local_offset[kMaxLowLatencyRanks];  // our send region for member d, in our registered buffer
  uint64_t remote_offset;                      // our region in every receiver's registered buffer
  uint32_t peer[kMaxLowLatencyRanks];          // global rank of member d
  int self;                                    // our group position (our own rows need no message)
  uint32_t max_write_bytes;
  uint64_t timeout_ns;
  unsigned int* done;  // device word: send blocks finished (the last block resets it)
};

// Warp 0 of a send kernel's last block (proxy path), all lanes: pushes the message to member d. Lane 0 takes the
// region's used pieces from next_piece(begin, bytes) (false: no more), cuts them to max_write_bytes and queues
// them in `batch` (shared, 32 commands), then the fence; the warp pushes each full batch. First waits for d's
// acknowledgement of our previous message (its region for us is free then). False on a timeout (reported).
template <class NextPiece>
__device__ bool push_message(const ProxyOut& p, int d, NextPiece&& next_piece, Command* batch, uint64_t& head,
                             uint64_t& tail_seen, uint64_t deadline, DeviceErrors* err, int rank, int64_t timeout_s) {
  const int lane = threadIdx.x % kWarp;
  int ok = 1;
  if (lane == 0 && p.ack[d] && !wait_count(p.ack[d], p.ack_want[d], deadline)) {
    report(err, kPeerLate, rank, p.peer[d], int64_t(p.ack_want[d]), timeout_s);
    ok = 0;
  }
  if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
  uint64_t begin = 0, left = 0;  // lane 0: the piece being cut
  bool pieces_done = false, fenced = false;
  for (;;) {
    int n = 0;
    if (lane == 0)
      while (n < kWarp) {
        if (left > 0) {
          const uint32_t len = uint32_t(min(left, uint64_t(p.max_write_bytes)));
          batch[n++] = Command{Op::kWrite, 0, 0, p.peer[d], p.local_offset[d] + begin, p.remote_offset + begin, len, 0};
          begin += len;
          left -= len;
        } else if (!pieces_done) {
          pieces_done = !next_piece(begin, left);
          if (pieces_done) left = 0;
        } else {
          if (!fenced) batch[n++] = message_fence(p.peer[d]);
          fenced = true;
          break;
        }
      }
    n = __shfl_sync(0xffffffffu, n, 0);
    __syncwarp();
    if (n == 0) return true;
    if (!warp_push(p.ring, batch[min(lane, n - 1)], n, head, tail_seen, deadline)) {
      if (lane == 0) report(err, kRingFull, rank, p.peer[d], 0, timeout_s);
      return false;
    }
    __syncwarp();
  }
}

// Warp 0 of the last send block: the message to every other member, its pieces from pieces(member, i, begin,
// bytes) for i = 0, 1, ... until it returns false; stops at the first timeout (reported).
template <class Pieces>
__device__ void push_messages(const ProxyOut& p, int num_ranks, int rank, DeviceErrors* err, Pieces&& pieces) {
  __shared__ Command batch[kWarp];
  uint64_t head = 0, tail_seen = 0;
  // The rows and routing the messages send (this or an earlier kernel wrote them) land before any command does:
  // a push orders nothing before it (ring_producer.cuh).
  __threadfence_system();
  ring_position(p.ring, head, tail_seen);
  const uint64_t deadline = global_ns() + p.timeout_ns;
  for (int d = 0; d < num_ranks; ++d) {
    if (d == p.self) continue;
    int piece = 0;
    auto next_piece = [&](uint64_t& begin, uint64_t& bytes) { return pieces(d, piece++, begin, bytes); };
    if (!push_message(p, d, next_piece, batch, head, tail_seen, deadline, err, rank,
                      int64_t(p.timeout_ns / 1000000000ull)))
      return;
  }
}

// After a receive on the proxy path (one warp): tells every other member we read its message (a fence-only
// message each), so it may write our region again.
__global__ void acknowledge_kernel(ProxyOut p, int num_ranks, DeviceErrors* err, int rank) {
  uint64_t head = 0, tail_seen = 0;
  ring_position(p.ring, head, tail_seen);
  const int lane = threadIdx.x % kWarp, d = lane < p.self ? lane : lane + 1;  // the lane's member (not us)
  const Command cmd = lane < num_ranks - 1 ? message_fence(p.peer[d]) : Command{};
  if (!warp_push(p.ring, cmd, num_ranks - 1, head, tail_seen, global_ns() + p.timeout_ns) && lane == 0)
    report(err, kRingFull, rank, -1, 0, int64_t(p.timeout_ns / 1000000000ull));
}

// Which op's send half waits in a device's op state for its receive half.
enum class ProxyOp { kLowLatencyDispatch, kLowLatencyCombine, kNormal };

// What a send half leaves in the device's op state for its receive half.
struct ProxyPending {
  ProxyOp op;
};

// One half of a low-latency op on the proxy path, host side, under the device's op lock. The kernels do the
// protocol's steps; the host waits for them and then brings its own state in step with what they did. A failure
// that leaves this rank out of step (a peer or the proxy did not answer, a launch failed) tells the peers; errors
// in the op's inputs stay for check_proxy_errors(), as on NVLink, so that no op fails on one rank only.
class ProxyHalf {
 public:
  ProxyHalf(uccl_ep::Device& dev, const Group& g, const char* op, cudaStream_t stream)
      : dev_(dev), g_(g), op_(op), stream_(stream), lock_(dev.op_mutex()) {
    dev.check_usable(op);
    if (dev.ring(0).capacity() < 2 * kWarp)  // a warp pushes up to 32 commands at once
      throw std::invalid_argument(std::string("uccl_ep ") + op + ": GPU-initiated ops need command rings of at least " +
                                  std::to_string(2 * kWarp) + " slots");
    check(cudaSetDevice(dev.ordinal()), "cudaSetDevice");
    gpu_ = &proxy_gpu(dev.ordinal());
    buffer_ = device_view(dev.buffer());
  }
  DeviceErrors* errors() const { return gpu_->errors_device; }

  // The send half: `launch()` enqueues the send kernel, once our send regions are free (earlier writes completed).
  // Refused while another op's send half waits for its receive half.
  template <class Launch>
  void send(ProxyOp op, Launch&& launch) {
    in_step([&] {
      check_no_pending_half(dev_, op_);
      dev_.quiet(op_);
      launch();
    });
    finish();
    consume(true);
    dev_.op_state() = ProxyPending{op};
  }
  // The receive half: `launch()` enqueues the receive kernel; every sender is acknowledged after it.
  template <class Launch>
  void receive(ProxyOp op, Launch&& launch) {
    const auto* p = std::any_cast<ProxyPending>(&dev_.op_state());
    if (!p || p->op != op)
      throw CollectiveError(std::string("uccl_ep ") + op_ + ": no send half of " + op_ + " is waiting on this device");
    dev_.op_state().reset();
    in_step([&] {
      launch();
      acknowledge_kernel<<<1, kWarp, 0, stream_>>>(proxy_out(), g_.size, errors(), int(dev_.rank()));
      check(cudaGetLastError(), "low_latency acknowledge kernel");
    });
    finish();
    consume(false);
  }

  ProxyOut proxy_out() const {
    ProxyOut p{};
    p.ring = device_ring(dev_.ring(0));
    for (int d = 0; d < g_.size; ++d) {
      const uint32_t peer = uint32_t(g_.ranks[d]);
      p.peer[d] = peer;
      p.local_offset[d] = dev_.send_offset(peer);
      if (d != g_.self && dev_.awaiting_ack(peer)) {
        p.ack[d] = device_view(dev_.released_word(peer, 0));
        p.ack_want[d] = dev_.consumed(peer, 0) + 1;
      }
    }
    p.remote_offset = dev_.recv_offset(dev_.rank());
    p.self = g_.self;
    p.max_write_bytes = dev_.max_write_bytes();
    p.timeout_ns = timeout_ns();
    p.done = gpu_->done;
    return p;
  }
  uccl_ep::Device& dev() const { return dev_; }
  const Group& group() const { return g_; }
  // Our registered buffer as the GPU sees it (mapped host memory).
  char* buffer() const { return buffer_; }
  ProxyGpu& gpu() const { return *gpu_; }

 private:
  std::string where() const { return std::string("uccl_ep ") + op_ + ": rank " + std::to_string(dev_.rank()) + " "; }
  // Consumes on the host what the kernels consumed on channel 0: each other member's acknowledgement the send
  // kernel awaited (`acks`; none is owed then), or each one's message (it is owed an acknowledgement then). The
  // messages are in already, unless an earlier error ended a kernel's wait.
  void consume(bool acks) {
    in_step([&] {
      for (int d = 0; d < g_.size; ++d) {
        const uint32_t peer = uint32_t(g_.ranks[d]);
        if (d == g_.self || (acks && !dev_.awaiting_ack(peer))) continue;
        dev_.wait_message(0, peer, op_);
        dev_.awaiting_ack(peer) = !acks;
      }
    });
  }
  // Runs a step that leaves this rank out of step with its peers if it fails: they are told, then it is raised.
  template <class Steps>
  void in_step(Steps&& steps) {
    try {
      steps();
    } catch (const std::exception& x) {
      dev_.abort(std::vector<uint32_t>(g_.ranks, g_.ranks + g_.size), x.what());
      throw;
    }
  }
  // Waits for the kernels. A peer or the proxy that did not answer in time (5, 10), or a corrupt message (7),
  // leaves this rank out of step; input errors wait for check_proxy_errors().
  void finish() {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    in_step([&] {
      if (e != cudaSuccess) throw Error(where() + "kernel failed: " + cudaGetErrorString(e));
      DeviceErrors err;
      std::memcpy(&err, const_cast<const DeviceErrors*>(gpu_->errors_host), sizeof(err));
      if (err.code != kPeerLate && err.code != kUnknownRowSource && err.code != kRingFull) return;
      std::memset(gpu_->errors_host, 0, sizeof(DeviceErrors));
      raise_device_error(err, where());
    });
  }

  uccl_ep::Device& dev_;
  const Group& g_;
  const char* op_;
  cudaStream_t stream_;
  std::lock_guard<std::mutex> lock_;
  ProxyGpu* gpu_ = nullptr;
  char* buffer_ = nullptr;
};

// A message holds at most kMaxWritesPerMessage writes (proxy/ordering.hpp): `pieces` pieces of `bytes` in all,
// each cut to the proxy's largest write, and the fence.
bool fits_writes(const uccl_ep::Device& dev, int64_t pieces, int64_t bytes) {
  return pieces + (bytes + dev.max_write_bytes() - 1) / dev.max_write_bytes() + 1 <= int64_t(kMaxWritesPerMessage);
}

}  // namespace
}  // namespace uccl_ep::nvl
