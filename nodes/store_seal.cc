// SPDX-License-Identifier: Apache-2.0
#include "nodes/store_seal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace rp::nodes {
namespace {

std::string Hmac(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

}  // namespace

std::string HexOf(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes.size());
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

// Two keys from one secret, each for one use: the prefix is public to anyone who can list the
// store's keys, so it must reveal nothing about the key that makes the tags.
StoreSeal::StoreSeal(std::string_view secret)
    : mac_key_(Hmac(secret, "rp node store: value tags")),
      prefix_("rp-" + HexOf(Hmac(secret, "rp node store: key prefix")).substr(0, 16) + "/") {}

std::string StoreSeal::Tag(std::string_view key, std::string_view value) const {
  // The key's length first, so no other split of the same bytes into key and value tags alike.
  std::string message = std::to_string(key.size()) + ":";
  message.append(key);
  message.append(value);
  return Hmac(mac_key_, message);
}

std::string StoreSeal::Seal(std::string_view key, std::string_view value) const {
  std::string out(value);
  out += Tag(key, value);
  return out;
}

StatusOr<std::string> StoreSeal::Open(std::string_view key, std::string_view sealed) const {
  const auto tampered = [&] {
    return Status::ProtocolError(
        "the node store's value of " + std::string(key) +
        " fails authentication: it was altered, or written by a process without this run's "
        "secret (tampering with the store, or a node whose RP_NODE_SECRET differs)");
  };
  if (sealed.size() < kTagBytes) return tampered();
  const std::string_view value = sealed.substr(0, sealed.size() - kTagBytes);
  const std::string want = Tag(key, value);
  if (CRYPTO_memcmp(want.data(), sealed.data() + value.size(), kTagBytes) != 0) return tampered();
  return std::string(value);
}

}  // namespace rp::nodes
