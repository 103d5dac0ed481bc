// What a region of the proxy runtime's buffer (one per peer and direction) must hold for a job's shapes, on the
// paths that move its rows through the proxies: kernels/cpu's rounds (CPU devices, GPUs staged through the host)
// and, on GPUs, the GPU-initiated ops (kernels/nvl's messages and low-latency regions).
#pragma once
#include <cstdint>

#include "contract.hpp"

namespace uccl_ep {

// How an EP group's normal-mode ops cross nodes (jax_uccl_ep decides, as initialize() and the plan would).
enum class NodeRouting {
  kFlat,          // every rank sends every rank
  kHierarchical,  // kernels/cpu's rounds: across nodes to the rank of one's own local index, then within the node
  kTwoLevel,      // an op across nodes, then one within each node (over NVLink on GPUs, else through the proxies)
};

struct ProxyShapes {
  int num_ranks = 1;    // the job's (the buffer holds a region per rank)
  int group_ranks = 1;  // an EP group's: the ranks its ops run over
  NodeRouting routing = NodeRouting::kFlat;
  int ranks_per_node = 0;  // hierarchical and two-level: a node's ranks
  int group_nodes = 1;     // hierarchical: the most nodes a group's rounds span
  bool gpus = false;       // GPU ranks (their ops across nodes may be GPU-initiated)
  int num_tokens = 0;      // per rank, normal mode (0: no normal-mode ops)
  int hidden = 0;
  int64_t x_row_bytes = 0, scale_row_bytes = 0;  // a dispatched row and its scales (FP8)
  int topk = 0;
  bool weights = false;                        // dispatch carries the router weights
  FloatType combine_dtype = FloatType::kBF16;  // combine's rows, and the gradients' rows of the backward passes
  int low_latency_max_tokens = 0;              // max_tokens_per_rank of low-latency ops (0: none)
  int num_experts = 0;                         // low-latency ops' (their regions count rows per local expert)
  int64_t low_latency_x_row_bytes = 0, low_latency_scale_row_bytes = 0;  // a low-latency dispatch's rows
  FloatType low_latency_combine_dtype = FloatType::kBF16;
};

// The largest message of any op of these shapes, whatever the routing of tokens, on those paths.
uint64_t proxy_region_bytes(const ProxyShapes& shapes);

}  // namespace uccl_ep
