// SPDX-License-Identifier: Apache-2.0
// The process environment: the one place the programs read it.
//
// Contract:
//  * EnvironmentValue(name) is the variable's value, or nullopt when it is unset. Every read of
//    the environment in the product's code goes through it (tests/tools/environment_test.sh
//    checks that no other file calls getenv or reads environ), so what a process consults is
//    found with one search: the job's RP_* switches (BenchKnobs), the test hooks
//    (common/test_hooks.h, which reads its variables once), the node world (torchrun's and
//    Slurm's variables), the run's secret, GPU visibility and the Hugging Face cache.
//  * Thread-safe as getenv is: the programs set no variable after they start threads (children
//    get an environment built for them, never this process's edited).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace rp {

std::optional<std::string> EnvironmentValue(const char* name);
// Every variable as "NAME=value", in the environment's order: what a child inherits.
std::vector<std::string> EnvironmentEntries();
inline std::optional<std::string> EnvironmentValue(const std::string& name) {
  return EnvironmentValue(name.c_str());
}

}  // namespace rp
