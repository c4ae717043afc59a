// SPDX-License-Identifier: Apache-2.0
#include "launcher/node_world.h"
#include "common/environment.h"

#include <cstdlib>
#include <limits>

namespace rp::launch {
namespace {

// A decimal integer in [lo, hi], all of `text`; `what` names it in the error.
StatusOr<int> ParseInt(const std::string& text, int lo, int hi, const std::string& what) {
  if (text.empty() || text.size() > 10 || text.find_first_not_of("0123456789") != std::string::npos)
    return Status::InvalidArgument(what + ": \"" + text + "\" is not a non-negative integer");
  const long v = std::strtol(text.c_str(), nullptr, 10);
  if (v < lo || v > hi)
    return Status::InvalidArgument(what + ": " + text + " is outside [" + std::to_string(lo) +
                                   ", " + std::to_string(hi) + "]");
  return static_cast<int>(v);
}

StatusOr<std::string> Required(const EnvLookup& env, const std::string& name,
                               const std::string& why) {
  auto v = env(name);
  if (!v || v->empty()) return Status::InvalidArgument(name + " is not set (" + why + ")");
  return *v;
}

Status CheckRank(const NodeWorld& w, const std::string& rank_name, const std::string& size_name) {
  if (w.rank >= w.nodes)
    return Status::InvalidArgument(rank_name + " = " + std::to_string(w.rank) + " is not below " +
                                   size_name + " = " + std::to_string(w.nodes));
  return Status::Ok();
}

// "host:port" or "[v6]:port".
Status ParseMaster(const std::string& master, NodeWorld* w) {
  const size_t colon = master.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return Status::InvalidArgument("--master: \"" + master + "\" is not ADDR:PORT");
  std::string host = master.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host.empty()) return Status::InvalidArgument("--master: \"" + master + "\" has no address");
  RP_ASSIGN_OR_RETURN(w->store_port,
                      ParseInt(master.substr(colon + 1), 1, 65535, "--master's port"));
  w->store_host = host;
  return Status::Ok();
}

// One bracket's content "01-03,7" into its items, each keeping the padding of its first bound.
StatusOr<std::vector<std::string>> ExpandRanges(const std::string& body, const std::string& list) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= body.size()) {
    const size_t comma = std::min(body.find(',', pos), body.size());
    const std::string item = body.substr(pos, comma - pos);
    const size_t dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    auto a = ParseInt(lo, 0, std::numeric_limits<int>::max(), "host list \"" + list + "\"");
    auto b = ParseInt(hi, 0, std::numeric_limits<int>::max(), "host list \"" + list + "\"");
    if (!a.ok()) return a.status();
    if (!b.ok()) return b.status();
    if (*b < *a || *b - *a > 100000)
      return Status::InvalidArgument("host list \"" + list + "\": range " + item +
                                     " is empty or too long");
    for (int v = *a; v <= *b; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
      out.push_back(s);
    }
    pos = comma + 1;
  }
  return out;
}

}  // namespace

std::optional<std::string> ProcessEnv(const std::string& name) { return EnvironmentValue(name); }

StatusOr<std::vector<std::string>> ExpandHostList(const std::string& list) {
  std::vector<std::string> hosts;
  size_t pos = 0;
  while (pos < list.size()) {
    // One host pattern: up to the next comma outside brackets.
    size_t end = pos;
    int depth = 0;
    for (; end < list.size(); ++end) {
      if (list[end] == '[') depth++;
      if (list[end] == ']') depth--;
      if (depth < 0 || depth > 1)
        return Status::InvalidArgument("host list \"" + list + "\": unbalanced brackets");
      if (list[end] == ',' && depth == 0) break;
    }
    if (depth != 0)
      return Status::InvalidArgument("host list \"" + list + "\": unbalanced brackets");
    const std::string pattern = list.substr(pos, end - pos);
    if (pattern.empty())
      return Status::InvalidArgument("host list \"" + list + "\": an empty host name");
    // The cartesian product of its bracket groups, leftmost varying slowest.
    std::vector<std::string> expanded = {""};
    size_t p = 0;
    while (p < pattern.size()) {
      const size_t open = pattern.find('[', p);
      const std::string literal =
          pattern.substr(p, open == std::string::npos ? std::string::npos : open - p);
      for (auto& e : expanded) e += literal;
      if (open == std::string::npos) break;
      const size_t close = pattern.find(']', open);
      RP_ASSIGN_OR_RETURN(auto items,
                          ExpandRanges(pattern.substr(open + 1, close - open - 1), list));
      std::vector<std::string> next;
      for (const auto& e : expanded)
        for (const auto& i : items) next.push_back(e + i);
      expanded = std::move(next);
      p = close + 1;
    }
    hosts.insert(hosts.end(), expanded.begin(), expanded.end());
    pos = end + 1;
    if (end + 1 == list.size())
      return Status::InvalidArgument("host list \"" + list + "\" ends with a comma");
  }
  if (hosts.empty()) return Status::InvalidArgument("host list \"" + list + "\" names no host");
  return hosts;
}

StatusOr<NodeWorld> ResolveNodeWorld(const NodeFlags& flags, const EnvLookup& env) {
  NodeWorld w;
  constexpr int kMaxNodes = 65536;
  if (flags.nnodes > 0 || flags.node_rank >= 0 || !flags.master.empty()) {
    w.source = "flags";
    w.nodes = flags.nnodes > 0 ? flags.nnodes : 1;
    if (w.nodes > kMaxNodes)
      return Status::InvalidArgument("--nnodes: at most " + std::to_string(kMaxNodes));
    if (w.nodes == 1 && flags.node_rank <= 0 && flags.master.empty()) return NodeWorld{};
    if (flags.nnodes <= 0) return Status::InvalidArgument("--node-rank and --master need --nnodes");
    if (flags.node_rank < 0)
      return Status::InvalidArgument("--nnodes " + std::to_string(w.nodes) + " needs --node-rank");
    if (flags.master.empty())
      return Status::InvalidArgument(
          "--nnodes " + std::to_string(w.nodes) +
          " needs --master ADDR:PORT (node 0's address; its rp-launch listens there)");
    w.rank = flags.node_rank;
    RP_RETURN_IF_ERROR(CheckRank(w, "--node-rank", "--nnodes"));
    RP_RETURN_IF_ERROR(ParseMaster(flags.master, &w));
    return w;
  }
  if (env("WORLD_SIZE") && env("RANK")) {
    w.source = "torchrun";
    RP_ASSIGN_OR_RETURN(w.nodes, ParseInt(*env("WORLD_SIZE"), 1, kMaxNodes, "WORLD_SIZE"));
    RP_ASSIGN_OR_RETURN(w.rank, ParseInt(*env("RANK"), 0, kMaxNodes, "RANK"));
    RP_RETURN_IF_ERROR(CheckRank(w, "RANK", "WORLD_SIZE"));
    if (auto local = env("LOCAL_WORLD_SIZE"); local && *local != "1")
      return Status::InvalidArgument(
          "LOCAL_WORLD_SIZE = " + *local +
          ": run torchrun with --nproc-per-node 1 (rp-launch starts the workers of its "
          "node itself, one per GPU of --gpus)");
    if (w.nodes == 1) return NodeWorld{};
    RP_ASSIGN_OR_RETURN(w.store_host, Required(env, "MASTER_ADDR", "torchrun sets it"));
    if (auto own = env("RP_MASTER_PORT")) {
      RP_ASSIGN_OR_RETURN(w.store_port, ParseInt(*own, 1, 65535, "RP_MASTER_PORT"));
    } else {
      RP_ASSIGN_OR_RETURN(std::string port, Required(env, "MASTER_PORT", "torchrun sets it"));
      RP_ASSIGN_OR_RETURN(int p, ParseInt(port, 1, 65534, "MASTER_PORT"));
      w.store_port = p + 1;  // torchrun's own store listens on MASTER_PORT
    }
    return w;
  }
  if (env("SLURM_NTASKS") && env("SLURM_PROCID")) {
    w.source = "slurm";
    RP_ASSIGN_OR_RETURN(w.nodes, ParseInt(*env("SLURM_NTASKS"), 1, kMaxNodes, "SLURM_NTASKS"));
    RP_ASSIGN_OR_RETURN(w.rank, ParseInt(*env("SLURM_PROCID"), 0, kMaxNodes, "SLURM_PROCID"));
    RP_RETURN_IF_ERROR(CheckRank(w, "SLURM_PROCID", "SLURM_NTASKS"));
    if (w.nodes == 1) return NodeWorld{};
    if (auto per = env("SLURM_NTASKS_PER_NODE"); per && *per != "1")
      return Status::InvalidArgument(
          "SLURM_NTASKS_PER_NODE = " + *per +
          ": run one rp-launch per node (srun --ntasks-per-node 1); it starts the workers "
          "of its node itself");
    if (auto addr = env("MASTER_ADDR"); addr && !addr->empty()) {
      w.store_host = *addr;
    } else {
      // The step's hosts (srun may use part of the allocation), else the job's.
      auto list = env("SLURM_STEP_NODELIST");
      if (!list || list->empty()) list = env("SLURM_JOB_NODELIST");
      if (!list || list->empty()) list = env("SLURM_NODELIST");
      if (!list || list->empty())
        return Status::InvalidArgument(
            "SLURM_JOB_NODELIST is not set (srun sets it; or set MASTER_ADDR)");
      RP_ASSIGN_OR_RETURN(auto hosts, ExpandHostList(*list));
      w.store_host = hosts.front();
    }
    w.store_port = 29500;
    if (auto port = env("MASTER_PORT"); port && !port->empty()) {
      RP_ASSIGN_OR_RETURN(w.store_port, ParseInt(*port, 1, 65535, "MASTER_PORT"));
    }
    return w;
  }
  return w;
}

}  // namespace rp::launch
