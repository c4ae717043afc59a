// SPDX-License-Identifier: Apache-2.0
// RunSpec: a run resolved once, by rp-launch, and read by every other process of it.
//
// Contract:
//  * ResolveRun() is the one place a run's decisions are made: the job file with its overrides
//    and the RP_* switches (LoadJobConfig: config.json's architecture, merged calls, typed modes),
//    the execution plan its mode keys resolve to (ResolveExecution), and the pipeline plan for
//    `workers` workers (MakePlan; the planner's search for partition =
//    "auto"). Pure given its inputs (the job file, the model's config.json, a stored profile).
//    With several nodes (`nodes`), the plan is for this node's share of each step, node r > 0
//    writes into <job.output_dir>/node-<r> and reads node 0's checkpoints, and dead workers are
//    not replaced (their reduction group spans the nodes and cannot take a newcomer).
//  * WriteRunSpec() stores it as JSON (atomically); ReadRunSpec() gives back an equal RunSpec:
//    the coordinator and the workers read it instead of parsing the job file and planning, so
//    they cannot disagree. A file that is not a complete spec of this version is an
//    InvalidArgument naming the file and the field, never an exception.
//  * RunSpecJson() is the text WriteRunSpec stores (rp-launch --dry-run prints it).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "config/execution_plan.h"
#include "config/job_config.h"
#include "planning/partitioner.h"
#include "planning/plan.h"

namespace rp::core {

struct RunSpec {
  JobConfig job;
  ExecutionPlan execution;  // ResolveExecution(job), stored so no process derives it again
  PipelinePlan plan;
  int workers = 1;
};

// What rp-launch decides about one launch of a run before resolving it, passed as values rather
// than as job-key overrides: the profile it froze for planning (empty: the job's own
// schedule.profile), and whether re-planning is off (the run has re-planned as often as allowed).
struct SessionInputs {
  std::string frozen_profile;
  bool replanning_off = false;
  // The shared-memory count schedule.host_memory_gb plans against (shm::SharedBytesFor).
  SharedBytesOf shared_bytes;
};

StatusOr<RunSpec> ResolveRun(const std::string& job_path, const std::vector<std::string>& overrides,
                             int workers, const NodesConfig& nodes = {}, const HostFacts& host = {},
                             const SessionInputs& session = {});
// The output directory every node of a resolved job shares: node 0's, in which ResolveRun puts
// node r > 0's own outputs as node-r.
std::string SharedOutputDir(const JobConfig& job);
std::string RunSpecJson(const RunSpec& spec);
StatusOr<RunSpec> ParseRunSpec(const std::string& json, const std::string& what);
Status WriteRunSpec(const std::string& path, const RunSpec& spec);
StatusOr<RunSpec> ReadRunSpec(const std::string& path);
// ReadRunSpec, refusing a spec resolved for another worker count than this process was given.
StatusOr<RunSpec> ReadRunSpecFor(const std::string& path, int workers);

}  // namespace rp::core
