// SPDX-License-Identifier: Apache-2.0
#include "nodes/node_store.h"

#include <thread>

#include "common/time_util.h"
#include "rp_config.h"

#if RP_WITH_C10D
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace rp::nodes {

#if RP_WITH_C10D
struct NodeStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

namespace {

std::chrono::milliseconds Millis(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0));
}

// c10d reports everything (refused connections, timeouts, resets) by throwing.
template <typename F>
Status Guard(const std::string& what, F&& f) {
  try {
    f();
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::Unavailable(what + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Unavailable(what + ": " + e.what());
  }
}

StatusOr<std::unique_ptr<NodeStore::Impl>> Open(const std::string& host, int port, double timeout_s,
                                                bool server) {
  auto impl = std::make_unique<NodeStore::Impl>();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = server;
  opts.waitWorkers = false;
  opts.timeout = Millis(timeout_s);
  const std::string where = host + ":" + std::to_string(port);
  Status s = Guard(server ? "cannot host the node store on port " + std::to_string(port)
                          : "cannot reach the node store at " + where + " within " +
                                std::to_string(static_cast<int>(timeout_s)) +
                                " s (is node 0's rp-launch running?)",
                   [&] { impl->store = c10::make_intrusive<c10d::TCPStore>(host, opts); });
  if (!s.ok()) return s;
  return impl;
}

}  // namespace

bool NodeStore::Available() { return true; }

StatusOr<std::unique_ptr<NodeStore>> NodeStore::Host(const std::string& host, int port,
                                                     double timeout_s, const StoreSeal& seal) {
  RP_ASSIGN_OR_RETURN(auto impl, Open(host, port, timeout_s, true));
  return std::unique_ptr<NodeStore>(
      new NodeStore(std::move(impl), host + ":" + std::to_string(port), timeout_s, seal));
}

StatusOr<std::unique_ptr<NodeStore>> NodeStore::Connect(const std::string& host, int port,
                                                        double timeout_s, const StoreSeal& seal) {
  RP_ASSIGN_OR_RETURN(auto impl, Open(host, port, timeout_s, false));
  return std::unique_ptr<NodeStore>(
      new NodeStore(std::move(impl), host + ":" + std::to_string(port), timeout_s, seal));
}

Status NodeStore::Set(const std::string& key, const std::string& value) {
  const std::string stored = seal_.Key(key);
  const std::string sealed = seal_.Seal(stored, value);
  return Guard("node store " + address_ + ": setting " + key, [&] {
    impl_->store->set(stored, std::vector<uint8_t>(sealed.begin(), sealed.end()));
  });
}

StatusOr<std::optional<std::string>> NodeStore::TryGet(const std::string& key) {
  const std::string stored = seal_.Key(key);
  std::optional<std::string> sealed;
  Status s = Guard("node store " + address_ + ": reading " + key, [&] {
    if (!impl_->store->check({stored})) return;
    const std::vector<uint8_t> v = impl_->store->get(stored);
    sealed = std::string(v.begin(), v.end());
  });
  if (!s.ok()) return s;
  if (!sealed) return std::optional<std::string>();
  RP_ASSIGN_OR_RETURN(std::string value, seal_.Open(stored, *sealed));
  return std::optional<std::string>(std::move(value));
}

Status NodeStore::Wait(const std::vector<std::string>& keys) {
  // Polled here, not c10d's wait: LibTorch 1.13's client waits past its timeout for a key that
  // is never set (a node that never arrives would hold the others forever).
  std::vector<std::string> stored;
  for (const auto& k : keys) stored.push_back(seal_.Key(k));
  const std::string what = keys.empty() ? std::string() : keys.front();
  const double deadline = MonoSeconds() + timeout_s_;
  for (;;) {
    bool all = false;
    RP_RETURN_IF_ERROR(Guard("node store " + address_ + ": waiting for " + what,
                             [&] { all = impl_->store->check(stored); }));
    if (all) return Status::Ok();
    if (MonoSeconds() > deadline)
      return Status::DeadlineExceeded("node store " + address_ + ": " + what +
                                      (keys.size() > 1 ? " and others" : "") + " not set within " +
                                      std::to_string(static_cast<int>(timeout_s_)) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

#else  // LibTorch without c10d

struct NodeStore::Impl {};

bool NodeStore::Available() { return false; }

StatusOr<std::unique_ptr<NodeStore>> NodeStore::Host(const std::string&, int, double,
                                                     const StoreSeal&) {
  return Status::InvalidArgument(
      "several nodes need LibTorch's c10d, which this build's LibTorch lacks");
}
StatusOr<std::unique_ptr<NodeStore>> NodeStore::Connect(const std::string&, int, double,
                                                        const StoreSeal&) {
  return Status::InvalidArgument(
      "several nodes need LibTorch's c10d, which this build's LibTorch lacks");
}
Status NodeStore::Set(const std::string&, const std::string&) {
  return Status::InvalidArgument("no c10d");
}
StatusOr<std::optional<std::string>> NodeStore::TryGet(const std::string&) {
  return Status::InvalidArgument("no c10d");
}
Status NodeStore::Wait(const std::vector<std::string>&) {
  return Status::InvalidArgument("no c10d");
}

#endif

NodeStore::NodeStore(std::unique_ptr<Impl> impl, std::string address, double timeout_s,
                     const StoreSeal& seal)
    : impl_(std::move(impl)), seal_(seal), address_(std::move(address)), timeout_s_(timeout_s) {}
NodeStore::~NodeStore() = default;

}  // namespace rp::nodes
