// SPDX-License-Identifier: Apache-2.0
// rp-plan job.toml --gpus N [--set section.key=value ...] [--json]
// Prints the plan schedule.partition = "auto" would run, with the planner's predictions (FLOP
// cost model; no measured profile yet). --json prints one JSON object and nothing else.
#include <CLI/CLI.hpp>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "core/job_config.h"
#include "core/partitioner.h"
#include "core/plan.h"

int main(int argc, char** argv) {
  std::string job;
  std::vector<std::string> overrides;
  int gpus = 1;
  bool json = false;
  CLI::App app{"Show the automatic pipeline plan for a job"};
  app.add_option("job", job, "job file (TOML)")->required();
  app.add_option("--gpus", gpus, "workers")->check(CLI::Range(1, 4096));
  app.add_option("--set", overrides, "override a job key: section.key=value (repeatable)");
  app.add_flag("--json", json, "print JSON only");
  CLI11_PARSE(app, argc, argv);
  auto cfg = rp::core::LoadJobConfig(job, overrides);
  if (!cfg.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", cfg.status().message().c_str());
    return rp::kExitBadConfig;
  }
  auto choice = rp::core::ChoosePlan(*cfg, gpus);
  if (!choice.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", choice.status().message().c_str());
    return rp::kExitBadConfig;
  }
  const auto& p = choice->plan;
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& s : p.stages)
    stages.push_back({{"kind", rp::core::StageKindName(s.kind)}, {"layers", {s.begin, s.end}}});
  if (json) {
    nlohmann::json out = {{"plan", p.Describe()}, {"stages", stages}, {"workers", gpus},
                          {"predicted_step_s", choice->step_seconds},
                          {"predicted_bubble_ratio", choice->bubble_ratio},
                          {"peak_memory_bytes_per_worker", choice->peak_memory_bytes},
                          {"assumed_flops_per_s_per_worker", choice->flops_per_second},
                          {"candidates", choice->candidates}, {"cost_model", "flops"}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("plan for %d workers: %s\n", gpus, p.Describe().c_str());
  std::printf("predicted step (one step from idle, FLOP cost model at %.3g FLOP/s per worker): %.3f s\n",
              choice->flops_per_second, choice->step_seconds);
  std::printf("predicted bubble ratio: %.1f%%\n", 100.0 * choice->bubble_ratio);
  std::printf("estimated peak memory per worker: %.2f GB\n", choice->peak_memory_bytes / 1e9);
  std::printf("(%d candidate plans evaluated; use with [schedule] partition = \"auto\")\n",
              choice->candidates);
  return 0;
}
