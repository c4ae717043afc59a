// SPDX-License-Identifier: Apache-2.0
#include "common/test_hooks.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "common/environment.h"

namespace rp {
namespace {

constexpr size_t kHookCount = sizeof(kTestHookVariables) / sizeof(kTestHookVariables[0]);

struct HookValues {
  std::optional<std::string> value[kHookCount];
};

const HookValues& Values() {
  static const HookValues values = [] {
    HookValues v;
    for (size_t i = 0; i < kHookCount; ++i) v.value[i] = EnvironmentValue(kTestHookVariables[i]);
    return v;
  }();
  return values;
}

}  // namespace

const char* TestHookValue(const char* name) {
  for (size_t i = 0; i < kHookCount; ++i) {
    if (std::strcmp(name, kTestHookVariables[i]) != 0) continue;
    const auto& value = Values().value[i];
    return value ? value->c_str() : nullptr;
  }
  std::fprintf(stderr, "TestHookValue: %s is not in kTestHookVariables (common/test_hooks.h)\n",
               name);
  std::abort();
}

}  // namespace rp
