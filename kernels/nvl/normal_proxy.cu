// Normal mode across nodes, GPU-initiated (api.hpp): the SM-store sides of normal.cuh and the scan of
// normal_scan.cuh as separate kernels, with the proxy runtime's registered buffer in place of the NVLink peers. The
// send kernel and a one-warp push of each member's message run on XLA's stream, then, once every member's message is
// in, the scan and the receive kernels.
#include <algorithm>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "api.hpp"
#include "device_common.cuh"
#include "normal.cuh"
#include "normal_scan.cuh"
#include "pair_layout.cuh"
#include "proxy_path.cuh"
#include "stamps.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

// The SM-store sides (normal.cuh), the scan's passes and combine's positions (normal_scan.cuh), a kernel each, and
// the wait for flags on the GPU.
__global__ void __launch_bounds__(kScanThreads) dispatch_count_kernel(ScanArgs a) {
  const KernelStamp stamp(KernelKind::kScan);
  count_unit<1>(a, blockIdx.x, blockIdx.y, gridDim.x);
}
__global__ void __launch_bounds__(kScanThreads) dispatch_place_kernel(ScanArgs a) {
  const KernelStamp stamp(KernelKind::kScan);
  place_unit<1>(a, blockIdx.x, blockIdx.y, gridDim.x, unit_takes<1>(a, blockIdx.x, blockIdx.y));
}
__global__ void __launch_bounds__(kScanThreads)
    positions_kernel(const bool* mask, int num_tokens, int num_ranks, int32_t* excl) {
  block_positions(mask, num_tokens, num_ranks, int(blockIdx.x), int(gridDim.x), excl);
}
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_send_kernel(DispatchSendArgs a) {
  dispatch_send(a, blockIdx.x, gridDim.x);
}
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_receive_kernel(DispatchReceiveArgs a) {
  dispatch_receive(a, blockIdx.x, gridDim.x);
}
__global__ void __launch_bounds__(kTransferThreads, 1) combine_send_kernel(CombineSendArgs a) {
  combine_send(a, blockIdx.x, gridDim.x);
}
template <typename T>
__global__ void __launch_bounds__(kTransferThreads, 1) combine_receive_kernel(CombineReceiveArgs a) {
  combine_receive<T>(a, blockIdx.x, gridDim.x);
}
// dispatch(layout="expert")'s pair layout (pair_layout.cuh), its passes a kernel each: a block a unit counts, then
// every block sums the counts, the units' blocks place their pairs and all mark the slots outside the groups.
__global__ void __launch_bounds__(kTransferThreads, 1) pair_count_kernel(PairLayout p, ScanArgs scan) {
  extern __shared__ __align__(128) char smem[];
  count_unit_pairs(p, scan, pair_tables(smem, p.groups), int(blockIdx.x));
}
__global__ void __launch_bounds__(kTransferThreads, 1) pair_place_kernel(PairLayout p, ScanArgs scan) {
  extern __shared__ __align__(128) char smem[];
  const PairTables t = pair_tables(smem, p.groups);
  pair_offsets(p, t, blockIdx.x == 0);
  for (int v = int(blockIdx.x); v < p.units; v += int(gridDim.x)) place_unit_pairs(p, scan, t, v);
  mark_pairs_outside(p, t, int(blockIdx.x), int(gridDim.x));
}
__global__ void wait_flags_kernel(FlagWaits w, uint64_t timeout_ns, DeviceErrors* err, int rank) {
  wait_all(w, timeout_ns, err, rank);
}

void run_scan(ScanArgs a, cudaStream_t stream) {
  const dim3 grid(scan_units(a.num_tokens, kScanThreads), a.num_ranks);
  dispatch_count_kernel<<<grid, kScanThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch_count_kernel");
  dispatch_place_kernel<<<grid, kScanThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch_place_kernel");
}

// The proxy path's send kernel (before its receive side, on the same stream).
template <class Args>
void launch_send(void (*kernel)(Args), const Args& a, cudaStream_t stream) {
  kernel<<<send_blocks(), kTransferThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "send kernel");
}

// The proxy path's receive side once the routing is in: the scan, then the rows; with `pairs` (dispatch(layout=
// "expert"), k.receive.pair_of set) the pair layout between them, and each row to its slots.
void launch_dispatch_receive(const DispatchKernels& k, cudaStream_t stream, const PairLayout* pairs = nullptr) {
  run_scan(k.scan, stream);
  if (pairs) {
    const size_t tables = pair_tables_bytes(pairs->groups, k.scan.topk, kTransferThreads);
    for (auto kernel : {pair_count_kernel, pair_place_kernel})
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tables)),
            "cudaFuncSetAttribute");
    pair_count_kernel<<<pairs->units, kTransferThreads, tables, stream>>>(*pairs, k.scan);
    check(cudaGetLastError(), "pair_count_kernel");
    pair_place_kernel<<<std::max(pairs->units, receive_blocks()), kTransferThreads, tables, stream>>>(*pairs, k.scan);
    check(cudaGetLastError(), "pair_place_kernel");
  }
  dispatch_receive_kernel<<<receive_blocks(), kTransferThreads, 0, stream>>>(k.receive);
  check(cudaGetLastError(), "dispatch_receive_kernel");
}
void launch_positions(const CombineArgs& a, int num_ranks, const Scratch& scratch, cudaStream_t stream) {
  positions_kernel<<<num_ranks, kScanThreads, 0, stream>>>(a.is_token_in_rank, a.num_tokens, num_ranks, scratch.excl);
  check(cudaGetLastError(), "positions_kernel");
}
void launch_combine_receive(const CombineReceiveArgs& ra, bool bf16, cudaStream_t stream) {
  if (bf16)
    combine_receive_kernel<__nv_bfloat16><<<receive_blocks(), kTransferThreads, 0, stream>>>(ra);
  else
    combine_receive_kernel<float><<<receive_blocks(), kTransferThreads, 0, stream>>>(ra);
  check(cudaGetLastError(), "combine_receive_kernel");
}

Members proxy_members(const ProxyHalf& half) {
  const Group& g = half.group();
  Members m{};
  m.num_ranks = g.size;
  m.self = g.self;
  m.rank = int(half.dev().rank());
  m.timeout_ns = timeout_ns();
  m.err = half.errors();
  for (int s = 0; s < g.size; ++s) m.rank_of[s] = g.ranks[s];
  return m;
}
// Member s's rows go to our send region for it (the push kernel sends them on); the progress words, of no use
// here (ProxyGpu), go to the sink, and no acknowledgement is awaited in the send kernel (the push kernel waits).
SendTo proxy_send_to(const ProxyHalf& half) {
  SendTo to{};
  static_cast<Members&>(to) = proxy_members(half);
  for (int s = 0; s < to.num_ranks; ++s) {
    if (s == to.self) continue;
    to.region[s] = half.buffer() + half.dev().send_offset(uint32_t(to.rank_of[s]));
    to.meta[s] = half.gpu().sink;
    to.chunks[s] = half.gpu().sink + 1;
    to.ack[s] = half.gpu().landed;  // >= 0 = message - 1
    to.message[s] = 1;
  }
  return to;
}
ReceiveFrom proxy_receive_from(const ProxyHalf& half) {
  ReceiveFrom from{};
  static_cast<Members&>(from) = proxy_members(half);
  for (int s = 0; s < from.num_ranks; ++s) {
    if (s == from.self) continue;
    from.region[s] = half.buffer() + half.dev().recv_offset(uint32_t(from.rank_of[s]));
    from.chunks[s] = half.gpu().landed;
    from.message[s] = 1;
  }
  return from;
}

// What the push kernel sends each member: pieces of our send region for it, piece i at offset[i] of
// fixed[i] + per_row[i] bytes per row the member gets (dispatch: from the send kernel's layout; combine: the rows
// it sent us).
struct MessagePieces {
  ProxyOut out;
  int num_ranks, rank, num_tokens, num_pieces;
  const int32_t* excl;    // dispatch: [T, R] the send kernel's layout
  const bool* mask;       // dispatch: [T, R]
  const int32_t* counts;  // combine: [R]
  uint64_t offset[4], fixed[4], per_row[4];
  DeviceErrors* err;
};
void add_piece(MessagePieces& m, size_t offset, size_t fixed, int64_t per_row) {
  m.offset[m.num_pieces] = offset;
  m.fixed[m.num_pieces] = fixed;
  m.per_row[m.num_pieces++] = uint64_t(per_row);
}
__global__ void push_messages_kernel(MessagePieces m) {
  const auto rows_to = [&](int d) -> uint64_t {
    if (m.counts) return uint64_t(max(m.counts[d], 0));
    if (m.num_tokens == 0) return 0;
    const int last = (m.num_tokens - 1) * m.num_ranks + d;  // rows before the last token, and its own
    return uint64_t(m.excl[last] + int(m.mask[last]));
  };
  push_messages(m.out, m.num_ranks, m.rank, m.err, [&](int d, int i, uint64_t& begin, uint64_t& bytes) {
    if (i >= m.num_pieces) return false;
    begin = m.offset[i];
    bytes = m.fixed[i] + rows_to(d) * m.per_row[i];
    return true;
  });
}

// Refusals before anything is sent: a message of `bytes` in `pieces` pieces to each member must fit a region of
// the proxy's buffer and a message's writes.
void check_proxy_message(const uccl_ep::Device& dev, const Group& g, size_t bytes, int pieces, const char* op) {
  if (g.size > kMaxRanks)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": GPU-initiated normal mode takes groups of at most " +
                                std::to_string(kMaxRanks) + " ranks, got " + std::to_string(g.size));
  if (bytes > dev.region_bytes()) {
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": a message of this shape needs " +
                                std::to_string(bytes) + " bytes per peer but a region of the proxy's buffer holds " +
                                std::to_string(dev.region_bytes()) + "; raise UCCL_EP_BUFFER_BYTES to at least " +
                                std::to_string(buffer_bytes_for_region(bytes, dev.num_ranks())) +
                                " (jax_uccl_ep.proxy_buffer_bytes gives it for a job's shapes)");
  }
  if (!fits_writes(dev, pieces, int64_t(bytes)))
    throw std::invalid_argument(
        std::string("uccl_ep ") + op +
        ": UCCL_EP_MAX_WRITE_BYTES is too small for these rows (a message may hold 2047 writes)");
}

// Where an op's extra scratch starts in ProxyGpu::scratch: after the rows' tables.
size_t extra_scratch_offset(int capacity, int num_tokens) { return align16(scratch_bytes(capacity, num_tokens)); }
// The ops' device scratch on the proxy path, grown as needed (every proxy op waits for its kernels, so none runs).
Scratch proxy_scratch(ProxyGpu& gpu, int capacity, int num_tokens, size_t extra_bytes = 0) {
  const size_t bytes = extra_scratch_offset(capacity, num_tokens) + extra_bytes;
  if (bytes > gpu.scratch_bytes) {
    if (gpu.scratch) cudaFree(gpu.scratch);
    gpu.scratch = nullptr;
    gpu.scratch_bytes = 0;
    check(cudaMalloc(&gpu.scratch, bytes), "cudaMalloc scratch");
    gpu.scratch_bytes = bytes;
  }
  return scratch_at(gpu.scratch, capacity, num_tokens);
}

// One op on the proxy path: the send kernel and the push on XLA's stream (ProxyHalf::send waits for them), then
// each member's message, and `receive` on it (ProxyHalf::receive acknowledges every member).
template <class Send, class Receive>
void run_over_proxy(ProxyHalf& half, MessagePieces m, cudaStream_t stream, Send&& send, Receive&& receive) {
  half.send(ProxyOp::kNormal, [&] {
    send();
    m.out = half.proxy_out();
    m.num_ranks = half.group().size;
    m.rank = int(half.dev().rank());
    m.err = half.errors();
    push_messages_kernel<<<1, kWarp, 0, stream>>>(m);
    check(cudaGetLastError(), "push_messages_kernel");
  });
  half.receive(ProxyOp::kNormal, [&] {
    uccl_ep::Device& dev = half.dev();
    const Group& g = half.group();
    FlagWaits w{};
    for (int s = 0; s < g.size; ++s) {
      if (s == g.self) continue;
      const uint32_t peer = uint32_t(g.ranks[s]);
      w.flag[w.n] = device_view(dev.released_word(peer, 0));
      w.value[w.n] = dev.consumed(peer, 0) + 1;
      w.peer[w.n++] = int(peer);
    }
    if (w.n) wait_flags_kernel<<<1, kWarp, 0, stream>>>(w, timeout_ns(), half.errors(), int(dev.rank()));
    check(cudaGetLastError(), "wait_flags_kernel");
    receive();
  });
}

}  // namespace

void set_proxy_kernel_stamps(uint64_t* stamps, cudaStream_t stream) {
  check(cudaMemcpyToSymbolAsync(g_kernel_stamps, &stamps, sizeof(stamps), 0, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyToSymbolAsync");
}

void preload_proxy_normal_kernels() {
  load_kernels(positions_kernel, dispatch_count_kernel, dispatch_place_kernel, dispatch_send_kernel,
               dispatch_receive_kernel, pair_count_kernel, pair_place_kernel, combine_send_kernel,
               combine_receive_kernel<float>, combine_receive_kernel<__nv_bfloat16>, wait_flags_kernel,
               push_messages_kernel, acknowledge_kernel);
}

namespace {
// A dispatch's message to each member: its rows (and scale rows), then our whole routing (and weights).
MessagePieces dispatch_message(const DispatchArgs& a, const DispatchLayoutBytes& l, const Scratch& scratch) {
  MessagePieces m{};
  m.num_tokens = a.num_tokens;
  m.excl = scratch.excl;
  m.mask = a.is_token_in_rank;
  add_piece(m, l.x, 0, a.x_row_bytes);
  add_piece(m, l.scales, 0, a.scale_row_bytes);
  add_piece(m, l.idx, size_t(a.num_tokens) * a.topk * 4, 0);
  if (a.topk_weights) add_piece(m, l.weights, size_t(a.num_tokens) * a.topk * 4, 0);
  return m;
}

// dispatch over the proxy; with `p` (dispatch(layout="expert"), `a` already redirected by pair_dispatch_args), the
// receive writes the pair buffer, its layout's counts in the scratch after the rows'.
void dispatch_over_proxy(uccl_ep::Device& dev, const Group& g, DispatchArgs a, const char* op, cudaStream_t stream,
                         const PairBuffer* p = nullptr) {
  ProxyHalf half(dev, g, "dispatch", stream);
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, a.topk_weights != nullptr);
  check_proxy_message(dev, g, l.total, 4, op);
  const int G = a.num_experts / g.size;
  const Scratch scratch = proxy_scratch(half.gpu(), a.capacity, a.num_tokens, p ? pair_scratch_bytes(*p, G) : 0);
  DispatchKernels k = dispatch_kernels(a, g, l, scratch, proxy_send_to(half), proxy_receive_from(half));
  PairLayout pairs{};
  if (p) {
    pairs =
        pair_layout(a, *p, G, static_cast<char*>(half.gpu().scratch) + extra_scratch_offset(a.capacity, a.num_tokens));
    k.receive.pair_of = p->pair_of;
    k.receive.pair_capacity = p->capacity;
  }
  run_over_proxy(
      half, dispatch_message(a, l, scratch), stream, [&] { launch_send(dispatch_send_kernel, k.send, stream); },
      [&] { launch_dispatch_receive(k, stream, p ? &pairs : nullptr); });
}
}  // namespace

void dispatch(uccl_ep::Device& dev, const Group& g, const DispatchArgs& a, cudaStream_t stream) {
  dispatch_over_proxy(dev, g, a, "dispatch", stream);
}

void dispatch_pairs(uccl_ep::Device& dev, const Group& g, DispatchArgs a, const PairBuffer& p, cudaStream_t stream) {
  const char* op = "dispatch(layout='expert')";
  check_pair_buffer(op, a, g.size, p, "over the proxy");
  dispatch_over_proxy(dev, g, pair_dispatch_args(a, p), op, stream, &p);
}

void cached_dispatch(uccl_ep::Device& dev, const Group& g, const CachedDispatchArgs& a, cudaStream_t stream) {
  ProxyHalf half(dev, g, "cached_dispatch", stream);
  check_proxy_message(dev, g, cached_message_bytes(a.num_tokens, a.row_bytes, g.size), 2, "cached_dispatch");
  const Scratch scratch = proxy_scratch(half.gpu(), a.capacity, a.num_tokens);
  const DispatchKernels k = cached_dispatch_kernels(a, g, scratch, proxy_send_to(half), proxy_receive_from(half));
  MessagePieces m{};
  m.num_tokens = a.num_tokens;
  m.excl = scratch.excl;
  m.mask = a.is_token_in_rank;
  add_piece(m, 0, 0, a.row_bytes);
  add_piece(m, cached_mask_offset(a.num_tokens, a.row_bytes), size_t(a.num_tokens) * g.size, 0);
  run_over_proxy(
      half, m, stream, [&] { launch_send(dispatch_send_kernel, k.send, stream); },
      [&] { launch_dispatch_receive(k, stream); });
}

void combine(uccl_ep::Device& dev, const Group& g, const CombineArgs& a, cudaStream_t stream) {
  ProxyHalf half(dev, g, "combine", stream);
  check_proxy_message(dev, g, combine_message_bytes(a.num_tokens, a.hidden, a.dtype), 1, "combine");
  const Scratch scratch = proxy_scratch(half.gpu(), 0, a.num_tokens);
  const CombineKernels k = combine_kernels(a, scratch, proxy_send_to(half), proxy_receive_from(half));
  MessagePieces m{};
  m.counts = a.recv_counts;
  add_piece(m, 0, 0, k.send.row_bytes);
  run_over_proxy(
      half, m, stream, [&] { launch_send(combine_send_kernel, k.send, stream); },
      [&] {
        launch_positions(a, g.size, scratch, stream);
        launch_combine_receive(k.receive, (a.dtype == FloatType::kBF16), stream);
      });
}

}  // namespace uccl_ep::nvl
