// SPDX-License-Identifier: Apache-2.0
// StoreSeal: what keeps the node store (c10d's TCPStore, which authenticates nobody) to the
// processes of one run. Anyone who reaches node 0's port can connect to the store; what they
// cannot do without the run's secret is name its keys or forge a value:
//  * every key the run uses lies under a prefix derived from the secret;
//  * every value carries an HMAC-SHA256 (OpenSSL's libcrypto) of its full key and its bytes, so
//    an altered value, one moved from another key, or one written by a process without the
//    secret fails Open() instead of being used.
// A deleted key is not detectable here; its readers wait, within their own bounds, as for a
// node that never wrote it. c10d's counters (add) carry no room for a tag: the run's own
// protocol uses sealed values only, and the counters c10d's collectives keep for themselves are
// under the secret prefix too.
//
// Contract:
//  * The secret is any non-empty byte string; the same secret gives the same prefix and tags in
//    every process and on every host (the nodes of a run agree through it alone).
//  * Open() returns the value Seal() was given for that key, or a ProtocolError naming the key and
//    tampering. Pure and thread-safe: no state but the derived keys.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace rp::nodes {

// The environment variable that holds the run's secret: set by the user (the same on every node)
// to choose it, and by rp-launch for its coordinator and workers.
inline constexpr char kRunSecretVariable[] = "RP_NODE_SECRET";

// `bytes` as lowercase hex, two digits a byte (the key prefix; a generated secret's text).
std::string HexOf(std::string_view bytes);

class StoreSeal {
 public:
  // The tag's length: an HMAC-SHA256.
  static constexpr size_t kTagBytes = 32;

  explicit StoreSeal(std::string_view secret);

  // "rp-" and 16 hex digits of a key derived from the secret, then "/".
  const std::string& prefix() const { return prefix_; }
  // `name` under the prefix: the key a value of the run is stored at.
  std::string Key(std::string_view name) const { return prefix_ + std::string(name); }

  // `value` followed by its tag for the store key `key` (the prefixed one).
  std::string Seal(std::string_view key, std::string_view value) const;
  StatusOr<std::string> Open(std::string_view key, std::string_view sealed) const;

 private:
  std::string Tag(std::string_view key, std::string_view value) const;

  std::string mac_key_;  // the tags' key, derived from the secret
  std::string prefix_;
};

}  // namespace rp::nodes
