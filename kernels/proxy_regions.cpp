#include "proxy_regions.hpp"

#include <algorithm>
#include <stdexcept>

#include "cpu/low_latency.hpp"
#include "cpu/normal.hpp"
#include "nvl/sizes.hpp"

namespace uccl_ep {

uint64_t proxy_region_bytes(const ProxyShapes& s) {
  const int T = std::max(0, s.num_tokens), P = s.ranks_per_node, group = std::max(1, s.group_ranks);
  // The rows combine returns; the dispatch's backward also returns the weights' gradients, float32 a slot.
  const int64_t combine_row = std::max<int64_t>(int64_t(s.hidden) * float_bytes(s.combine_dtype), 4 * s.topk);
  uint64_t need = 0;
  if (T > 0) {
    cpu::NormalShapes host;
    host.num_ranks = group, host.num_tokens = T, host.topk = s.topk, host.weights = s.weights;
    host.x_row_bytes = uint64_t(s.x_row_bytes), host.scale_row_bytes = uint64_t(s.scale_row_bytes);
    host.combine_row_bytes = uint64_t(combine_row);
    if (s.routing != NodeRouting::kFlat && P < 2)
      throw std::invalid_argument("uccl_ep: routing across nodes needs nodes of 2 or more ranks");
    if (s.routing == NodeRouting::kHierarchical)  // rounds as over group_nodes whole nodes: the most rows and bytes
      host.num_ranks = std::max(2, s.group_nodes) * P, host.node_size = P;
    if (s.routing == NodeRouting::kTwoLevel) {
      // The op across the nodes has a rank a node; on CPU devices the op within a node runs through the proxies
      // too, on the rows a rank got from every node.
      host.num_ranks = s.num_ranks / P;
      if (!s.gpus) {
        cpu::NormalShapes within = host;
        within.num_ranks = P, within.num_tokens = host.num_ranks * T;
        need = cpu::largest_message_bytes(within);
      }
    }
    need = std::max(need, cpu::largest_message_bytes(host));
    // GPU-initiated: NVLink's messages (room for every token's rows and the sender's routing), and the wider rows
    // of the backward passes besides (cached_dispatch's of x's width; the weights' gradients in combine).
    if (s.gpus)
      need = std::max<uint64_t>(
          {need,
           nvl::normal_message_bytes(group, T, s.x_row_bytes, s.scale_row_bytes, s.topk, s.weights, s.hidden,
                                     s.combine_dtype),
           nvl::cached_message_bytes(T, std::max(s.x_row_bytes + s.scale_row_bytes, combine_row), group),
           nvl::combine_message_bytes(T, s.topk, FloatType::kF32)});
  }
  if (s.low_latency_max_tokens > 0) {  // flat over the group
    const int64_t x_row = s.low_latency_x_row_bytes, scale_row = s.low_latency_scale_row_bytes;
    const int64_t y_row = int64_t(s.hidden) * float_bytes(s.low_latency_combine_dtype);
    need =
        std::max(need, cpu::largest_low_latency_message_bytes(group, s.num_experts, s.low_latency_max_tokens, s.topk,
                                                              uint64_t(x_row), uint64_t(scale_row), uint64_t(y_row)));
    if (s.gpus)
      need = std::max(need, uint64_t(nvl::low_latency_region_bytes(group, s.num_experts, s.low_latency_max_tokens,
                                                                   s.topk, x_row, scale_row, y_row)));
  }
  return need;
}

}  // namespace uccl_ep
