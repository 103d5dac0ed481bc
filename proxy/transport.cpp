#include "transport.hpp"

#include <dirent.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <sstream>

#include "errors.hpp"

namespace uccl_ep {
namespace {

void check(int rc, const char* what) {
  if (rc != 0) throw Error(std::string("uccl_ep transport: ") + what + " failed: " + fi_strerror(-rc));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// Little-endian byte writer/reader for the bootstrap blob.
struct Writer {
  std::vector<uint8_t> b;
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(uint8_t(v >> (8 * i)));
  }
  void bytes(const void* p, size_t n) {
    u64(n);
    b.insert(b.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  }
};
struct Reader {
  const std::vector<uint8_t>& b;
  size_t pos = 0;
  uint64_t u64() {
    if (pos + 8 > b.size()) throw Error("uccl_ep bootstrap: truncated endpoint info");
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(b[pos + i]) << (8 * i);
    pos += 8;
    return v;
  }
  std::vector<uint8_t> bytes() {
    uint64_t n = u64();
    if (pos + n > b.size()) throw Error("uccl_ep bootstrap: truncated endpoint info");
    std::vector<uint8_t> v(b.begin() + pos, b.begin() + pos + n);
    pos += n;
    return v;
  }
};

}  // namespace

void remove_stale_shm_segments() {
  const std::string prefix = std::to_string(getpid()) + ":";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* entry = readdir(dir)) {
    if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0)
      unlink((std::string("/dev/shm/") + entry->d_name).c_str());
  }
  closedir(dir);
}

namespace {
// Whether process `pid` of this host still runs (a zombie does not: it only waits to be reaped).
bool process_runs(long pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/stat", stat;
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char buf[512] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  stat.assign(buf, n);
  const size_t paren = stat.rfind(')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

// "fi_shm://<pid>:<domain>:<endpoint>" (maybe NUL-padded): the segment's name in /dev/shm and its owner's pid
// (pid -1 if the name has another form).
std::pair<std::string, long> shm_segment(const std::string& full) {
  std::string name = full.substr(0, full.find('\0'));
  const size_t slash = name.rfind('/');
  if (slash != std::string::npos) name = name.substr(slash + 1);
  const size_t colon = name.find(':');
  if (colon == 0 || colon == std::string::npos || name.find_first_not_of("0123456789") != colon) return {name, -1};
  return {name, std::stol(name.substr(0, colon))};
}

}  // namespace

void remove_dead_peers_shm_segments(const std::vector<std::string>& peer_names) {
  for (const std::string& full : peer_names) {
    const auto [name, pid] = shm_segment(full);
    if (pid < 0 || process_runs(pid)) continue;
    unlink(("/dev/shm/" + name).c_str());  // ENOENT when its owner did unlink it: fine
  }
}

std::vector<uint32_t> FabricDevice::exited_local_peers() const {
  std::vector<uint32_t> gone;
  for (const auto& [rank, pid] : local_peer_pids_)
    if (!process_runs(pid) && (gone.empty() || gone.back() != rank)) gone.push_back(rank);
  return gone;
}

std::vector<uint8_t> EndpointInfo::serialize() const {
  Writer w;
  w.u64(rank);
  w.u64(remote_base);
  w.u64(key);
  w.bytes(host.data(), host.size());
  w.u64(uint64_t(pid));
  w.u64(names.size());
  for (const auto& n : names) w.bytes(n.data(), n.size());
  return w.b;
}

EndpointInfo EndpointInfo::deserialize(const std::vector<uint8_t>& bytes) {
  Reader r{bytes};
  EndpointInfo info;
  info.rank = uint32_t(r.u64());
  info.remote_base = r.u64();
  info.key = r.u64();
  auto host = r.bytes();
  info.host.assign(host.begin(), host.end());
  info.pid = int64_t(r.u64());
  uint64_t n = r.u64();
  for (uint64_t i = 0; i < n; ++i) info.names.push_back(r.bytes());
  return info;
}

FabricDevice::FabricDevice(const std::string& providers, uint32_t rank, void* buffer, size_t bytes, int num_channels)
    : rank_(rank), buffer_(static_cast<char*>(buffer)), bytes_(bytes) {
  std::string tried;
  for (const auto& prov : split(providers, ',')) {
    fi_info* hints = fi_allocinfo();
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->fabric_attr->prov_name = strdup(prov.c_str());
    fi_info* info = nullptr;
    int rc = fi_getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc == 0 && info && info->domain_attr->cq_data_size >= 4) {
      info_ = info;
      provider_ = prov;
      break;
    }
    if (info) fi_freeinfo(info);
    tried += (tried.empty() ? "" : ", ") + prov + " (" + (rc ? fi_strerror(-rc) : "no 4-byte CQ data") + ")";
  }
  if (!info_) throw Error("uccl_ep transport: no libfabric provider with RDM endpoints and RMA writes: tried " + tried);

  check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
  check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");
  virt_addr_ = (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
  check(fi_mr_reg(domain_, buffer_, bytes_, FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ, 0,
                  /*requested_key=*/rank_ + 1, 0, &mr_, nullptr),
        "fi_mr_reg");
  mr_desc_ = fi_mr_desc(mr_);

  channels_.resize(num_channels);
  for (auto& ch : channels_) {
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 4096;
    check(fi_cq_open(domain_, &cq_attr, &ch.cq, nullptr), "fi_cq_open");
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    check(fi_av_open(domain_, &av_attr, &ch.av, nullptr), "fi_av_open");
    check(fi_endpoint(domain_, info_, &ch.ep, nullptr), "fi_endpoint");
    check(fi_ep_bind(ch.ep, &ch.cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    check(fi_ep_bind(ch.ep, &ch.av->fid, 0), "fi_ep_bind(av)");
    check(fi_enable(ch.ep), "fi_enable");
  }
}

FabricDevice::~FabricDevice() {
  for (auto& ch : channels_) {
    if (ch.ep) fi_close(&ch.ep->fid);
    if (ch.av) fi_close(&ch.av->fid);
    if (ch.cq) fi_close(&ch.cq->fid);
  }
  if (mr_) fi_close(&mr_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
}

std::string FabricDevice::host_name() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

EndpointInfo FabricDevice::local_info() const {
  EndpointInfo info;
  info.rank = rank_;
  info.remote_base = virt_addr_ ? reinterpret_cast<uint64_t>(buffer_) : 0;
  info.key = fi_mr_key(mr_);
  info.host = host_name();
  info.pid = int64_t(getpid());
  for (const auto& ch : channels_) {
    std::vector<uint8_t> name(256);
    size_t len = name.size();
    check(fi_getname(&ch.ep->fid, name.data(), &len), "fi_getname");
    name.resize(len);
    info.names.push_back(std::move(name));
  }
  return info;
}

void FabricDevice::connect(const std::vector<EndpointInfo>& peers) {
  peer_base_.resize(peers.size());
  peer_key_.resize(peers.size());
  for (size_t p = 0; p < peers.size(); ++p) {
    if (peers[p].names.size() != channels_.size())
      throw Error("uccl_ep bootstrap: rank " + std::to_string(p) + " has " + std::to_string(peers[p].names.size()) +
                  " channels, this rank " + std::to_string(channels_.size()) +
                  " (UCCL_EP_NUM_PROXY_THREADS must match on every process)");
    peer_base_[p] = peers[p].remote_base;
    peer_key_[p] = peers[p].key;
  }
  peer_shm_names_.clear();
  local_peer_pids_.clear();
  const std::string here = host_name();
  for (const auto& peer : peers) {
    if (peer.rank == rank_) continue;
    if (provider_ == "shm")
      for (const auto& n : peer.names) peer_shm_names_.emplace_back(n.begin(), n.end());
    // A peer on this host whose process is gone is the likely cause of a timeout (a survivor stuck on it may be the
    // rank that did not answer). Only a process we see now can be seen gone later (another pid namespace would
    // look gone throughout).
    if (peer.host == here && peer.pid > 0 && process_runs(long(peer.pid)))
      local_peer_pids_.emplace_back(uint32_t(peer.rank), long(peer.pid));
  }
  for (size_t c = 0; c < channels_.size(); ++c) {
    auto& ch = channels_[c];
    ch.peer_addr.assign(peers.size(), FI_ADDR_UNSPEC);
    for (size_t p = 0; p < peers.size(); ++p) {
      int n = fi_av_insert(ch.av, peers[p].names[c].data(), 1, &ch.peer_addr[p], 0, nullptr);
      if (n != 1) throw Error("uccl_ep transport: fi_av_insert failed for rank " + std::to_string(p));
    }
  }
}

bool FabricDevice::post_write(int channel, uint32_t peer, uint64_t local_offset, uint64_t remote_offset, size_t length,
                              uint32_t imm, void* context) {
  auto& ch = channels_[channel];
  ssize_t rc = fi_writedata(ch.ep, buffer_ + local_offset, length, mr_desc_, imm, ch.peer_addr[peer],
                            peer_base_[peer] + remote_offset, peer_key_[peer], context);
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0)
    throw Error("uccl_ep transport: fi_writedata to rank " + std::to_string(peer) + " failed: " + fi_strerror(-rc));
  return true;
}

int FabricDevice::poll(int channel, Completion* out, int max, std::string* error, void** error_context) {
  auto& ch = channels_[channel];
  fi_cq_data_entry entries[64];
  if (max > 64) max = 64;
  ssize_t n = fi_cq_read(ch.cq, entries, max);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    if (fi_cq_readerr(ch.cq, &err, 0) > 0) {
      char buf[256];
      const char* detail = fi_cq_strerror(ch.cq, err.prov_errno, err.err_data, buf, sizeof(buf));
      *error = std::string(fi_strerror(err.err)) + (detail ? std::string(": ") + detail : "");
      *error_context = err.op_context;
      return -1;
    }
    return 0;
  }
  if (n < 0) throw Error(std::string("uccl_ep transport: fi_cq_read failed: ") + fi_strerror(int(-n)));
  for (ssize_t i = 0; i < n; ++i) {
    out[i].remote_data = (entries[i].flags & FI_REMOTE_CQ_DATA) != 0;
    out[i].imm = uint32_t(entries[i].data);
    out[i].context = entries[i].op_context;
  }
  return int(n);
}

}  // namespace uccl_ep
