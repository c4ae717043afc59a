// SPDX-License-Identifier: Apache-2.0
// SealedStore: the c10d store that Gloo's and NCCL's rendezvous run on across the nodes, under
// the run's StoreSeal (nodes/store_seal.h): keys under the secret prefix, values sealed on set
// and opened on get. Their rendezvous exchanges addresses and NCCL's unique id through it, so a
// forged value would connect a worker to whoever wrote it; here it fails the join instead.
//
// Contract:
//  * get() and compareSet() throw std::runtime_error naming the key and tampering when a value
//    fails authentication (c10d reports everything by throwing; the callers turn it into a
//    Status). add() is forwarded unsealed under the prefix (a counter has no room for a tag).
//  * Thread-safety: as the wrapped store's.
//  * Included by nodes/node_reduction.cc and its tests only (it includes c10d).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#include "nodes/store_seal.h"

// LibTorch 2.6 made cloning a store part of its interface.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define RP_C10D_STORE_CLONE 1
#else
#define RP_C10D_STORE_CLONE 0
#endif

namespace rp::nodes {

class SealedStore : public c10d::Store {
 public:
  SealedStore(c10::intrusive_ptr<c10d::Store> inner, StoreSeal seal);

#if RP_C10D_STORE_CLONE
  c10::intrusive_ptr<c10d::Store> clone() override;
#endif
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  const std::chrono::milliseconds& getTimeout() const noexcept override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;

 private:
  std::vector<std::string> Keys(const std::vector<std::string>& keys) const;
  std::vector<uint8_t> Opened(const std::string& stored, const std::vector<uint8_t>& sealed) const;
  std::vector<uint8_t> Sealed(const std::string& stored, const std::vector<uint8_t>& value) const;

  c10::intrusive_ptr<c10d::Store> inner_;
  StoreSeal seal_;
};

}  // namespace rp::nodes
