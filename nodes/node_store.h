// SPDX-License-Identifier: Apache-2.0
// NodeStore: the key-value store the nodes of a multi-node run meet at (c10d's TCPStore). Node
// 0's rp-launch hosts it and every node's rp-launch is a client; the workers meet on the same
// store under their reductions' rendezvous (SealedStore). Coordinators never connect to it.
//
// Contract:
//  * Host() listens on `port` (every address) and is itself a client of what it hosts;
//    Connect() reaches a hosted store, retrying until `timeout`. Either fails with an
//    Unavailable naming the address.
//  * Every call is bounded by the timeout given at creation (c10d's own timeout, never infinite)
//    and returns a Status instead of throwing: a store that vanished (its host is gone, the
//    network is cut) is an Unavailable naming the address and the key.
//  * Keys are the caller's names; each is stored under the run's secret prefix and every value
//    is sealed (nodes/store_seal.h): TryGet() of a value that fails authentication is a
//    ProtocolError naming the key and tampering, never the value. There are no counters: c10d's
//    carry no tag. Not thread-safe: one owner.
//  * Available() is false in a build whose LibTorch has no c10d: then Host() and Connect() fail
//    saying so.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "nodes/store_seal.h"

namespace rp::nodes {

class NodeStore {
 public:
  static bool Available();
  static StatusOr<std::unique_ptr<NodeStore>> Host(const std::string& host, int port,
                                                   double timeout_s, const StoreSeal& seal);
  static StatusOr<std::unique_ptr<NodeStore>> Connect(const std::string& host, int port,
                                                      double timeout_s, const StoreSeal& seal);
  ~NodeStore();
  NodeStore(const NodeStore&) = delete;
  NodeStore& operator=(const NodeStore&) = delete;

  Status Set(const std::string& key, const std::string& value);
  // The value if the key exists now; never waits for it.
  StatusOr<std::optional<std::string>> TryGet(const std::string& key);
  // Waits (up to the timeout, then a DeadlineExceeded naming the first key) until every key exists.
  Status Wait(const std::vector<std::string>& keys);
  const std::string& address() const { return address_; }

  struct Impl;

 private:
  NodeStore(std::unique_ptr<Impl> impl, std::string address, double timeout_s,
            const StoreSeal& seal);
  std::unique_ptr<Impl> impl_;
  StoreSeal seal_;
  std::string address_;  // "host:port", for messages
  double timeout_s_;
};

}  // namespace rp::nodes
