// SPDX-License-Identifier: Apache-2.0
// The checks of a job's keys against each other, after each key's own type and range.
//
// Contract:
//  * CrossChecks() is the ordered table ParseJobConfig runs (through CrossValidate) once a job is
//    parsed and resolved: each entry names the keys its refusals begin with and returns the
//    first refusal it finds, an InvalidArgument naming the key and what conflicts with it.
//  * A check reads only the job and the files it names (data paths, lora.init_from); none changes
//    anything, so their order decides only which refusal a job with several problems hears first.
//  * ParseJobConfigBeforeCrossChecks() is ParseJobConfig up to the table: the job every check is
//    given. It exists so that a test can walk the table and see each entry refuse on its own.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"

namespace rp::core {

struct CrossCheck {
  const char* name;               // what the entry checks, in a few words
  std::vector<const char*> keys;  // the keys its refusals begin with
  Status (*check)(const JobConfig& job);
};

const std::vector<CrossCheck>& CrossChecks();

// Every entry of CrossChecks() in order; the first refusal.
Status CrossValidate(const JobConfig& job);

StatusOr<JobConfig> ParseJobConfigBeforeCrossChecks(const std::string& toml_text,
                                                    const std::string& base_dir,
                                                    const std::vector<std::string>& overrides,
                                                    const HostFacts& host = {});

}  // namespace rp::core
