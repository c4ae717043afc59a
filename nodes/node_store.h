// SPDX-License-Identifier: Apache-2.0
// NodeStore: the key-value store the nodes of a multi-node run meet at (c10d's TCPStore). Node
// 0's rp-launch hosts it; every launcher, coordinator and worker of every node is a client.
//
// Contract:
//  * Host() listens on `port` (every address) and is itself a client of what it hosts;
//    Connect() reaches a hosted store, retrying until `timeout`. Either fails with an
//    Unavailable naming the address.
//  * Every call is bounded by the timeout given at creation (c10d's own timeout, never infinite)
//    and returns a Status instead of throwing: a store that vanished (its host is gone, the
//    network is cut) is an Unavailable naming the address and the key.
//  * Keys are the caller's; nothing here interprets them. Not thread-safe: one owner.
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

namespace rp::nodes {

class NodeStore {
 public:
  static bool Available();
  static StatusOr<std::unique_ptr<NodeStore>> Host(const std::string& host, int port, double timeout_s);
  static StatusOr<std::unique_ptr<NodeStore>> Connect(const std::string& host, int port, double timeout_s);
  ~NodeStore();
  NodeStore(const NodeStore&) = delete;
  NodeStore& operator=(const NodeStore&) = delete;

  Status Set(const std::string& key, const std::string& value);
  // The value if the key exists now; never waits for it.
  StatusOr<std::optional<std::string>> TryGet(const std::string& key);
  // Adds `delta` to the counter `key` (created at 0) and returns the new value; Add(key, 0) reads.
  StatusOr<int64_t> Add(const std::string& key, int64_t delta);
  // Waits (up to the timeout) until every key exists.
  Status Wait(const std::vector<std::string>& keys);
  const std::string& address() const { return address_; }

  struct Impl;

 private:
  NodeStore(std::unique_ptr<Impl> impl, std::string address);
  std::unique_ptr<Impl> impl_;
  std::string address_;  // "host:port", for messages
};

}  // namespace rp::nodes
