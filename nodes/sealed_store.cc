// SPDX-License-Identifier: Apache-2.0
#include "rp_config.h"

#if RP_WITH_C10D
#include "nodes/sealed_store.h"

#include <stdexcept>

namespace rp::nodes {

SealedStore::SealedStore(c10::intrusive_ptr<c10d::Store> inner, StoreSeal seal)
    : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), seal_(std::move(seal)) {}

#if RP_C10D_STORE_CLONE
c10::intrusive_ptr<c10d::Store> SealedStore::clone() {
  return c10::make_intrusive<SealedStore>(inner_->clone(), seal_);
}
#endif

std::vector<std::string> SealedStore::Keys(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(seal_.Key(k));
  return out;
}

std::vector<uint8_t> SealedStore::Sealed(const std::string& stored,
                                         const std::vector<uint8_t>& value) const {
  const std::string s = seal_.Seal(
      stored, std::string_view(reinterpret_cast<const char*>(value.data()), value.size()));
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::vector<uint8_t> SealedStore::Opened(const std::string& stored,
                                         const std::vector<uint8_t>& sealed) const {
  auto opened = seal_.Open(
      stored, std::string_view(reinterpret_cast<const char*>(sealed.data()), sealed.size()));
  if (!opened.ok()) throw std::runtime_error(opened.status().message());
  return std::vector<uint8_t>(opened->begin(), opened->end());
}

void SealedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string stored = seal_.Key(key);
  inner_->set(stored, Sealed(stored, value));
}

std::vector<uint8_t> SealedStore::compareSet(const std::string& key,
                                             const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  // An empty expectation means "absent" to c10d and stays empty; every stored value is sealed.
  const std::string stored = seal_.Key(key);
  const auto now = inner_->compareSet(
      stored, expected.empty() ? expected : Sealed(stored, expected), Sealed(stored, desired));
  return now.empty() ? now : Opened(stored, now);
}

std::vector<uint8_t> SealedStore::get(const std::string& key) {
  const std::string stored = seal_.Key(key);
  return Opened(stored, inner_->get(stored));
}

int64_t SealedStore::add(const std::string& key, int64_t value) {
  return inner_->add(seal_.Key(key), value);
}
bool SealedStore::deleteKey(const std::string& key) { return inner_->deleteKey(seal_.Key(key)); }
bool SealedStore::check(const std::vector<std::string>& keys) { return inner_->check(Keys(keys)); }
int64_t SealedStore::getNumKeys() { return inner_->getNumKeys(); }
void SealedStore::wait(const std::vector<std::string>& keys) { inner_->wait(Keys(keys)); }
void SealedStore::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  inner_->wait(Keys(keys), timeout);
}
const std::chrono::milliseconds& SealedStore::getTimeout() const noexcept {
  return inner_->getTimeout();
}
void SealedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  inner_->setTimeout(timeout);
}

}  // namespace rp::nodes
#endif  // RP_WITH_C10D
