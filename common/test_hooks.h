// SPDX-License-Identifier: Apache-2.0
// Test-only fault switches: RP_TEST_* environment variables that fake a hang, a fault, a slow
// disk or a diverging step inside the programs, so the fault tests run the production paths.
//
// Contract:
//  * The variables are the ones kTestHookVariables names; TestHookValue() reads all of them from
//    the environment once, at a process's first use of any hook, and keeps them for the
//    process's life (a hook consulted per microbatch costs no environment read). A name outside
//    the list is a programming error: it aborts. Unset, every hook is off (production).
//  * ClaimTestHookOnce("RP_TEST_X") is true in exactly one process of a run: the first to create
//    the marker file the variable names (O_EXCL). Replacement processes inherit the same
//    environment but find the marker, so a fault fires once per run.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace rp {

inline constexpr const char* kTestHookVariables[] = {
    "RP_TEST_ALWAYS_REPLAN",     "RP_TEST_CHECKPOINT_ON_LOOP",  "RP_TEST_CUDA_FAULT_ONCE",
    "RP_TEST_DEVICE_HANG_ONCE",  "RP_TEST_DEVICE_UPDATE_NUDGE", "RP_TEST_FAIL_EVAL_ONCE",
    "RP_TEST_FAIL_POOL_ONCE",    "RP_TEST_HANG_ONCE",           "RP_TEST_LATE_COMPLETION_MS",
    "RP_TEST_NAN_AT_STEP",       "RP_TEST_NODE_SUMS_ALONE",     "RP_TEST_OVERFLOW_AT_STEPS",
    "RP_TEST_POISON_CHECKPOINT", "RP_TEST_REPLAN_ONCE",         "RP_TEST_SLOW_CHECKPOINT_MS",
    "RP_TEST_SLOW_EVAL_MS",      "RP_TEST_SLOW_FILL_MS",        "RP_TEST_SLOW_FROM_STEP",
    "RP_TEST_WELCOME_TIMEOUT_S",
};

// The variable's value as the process found it at its first hook, or nullptr when unset.
const char* TestHookValue(const char* name);

// The milliseconds an environment variable names, in seconds; 0 when it is unset or not positive.
inline double DelaySecondsFromEnv(const char* env_var) {
  const char* v = TestHookValue(env_var);
  const double ms = v == nullptr ? 0.0 : std::strtod(v, nullptr);
  return ms > 0 ? ms * 1e-3 : 0.0;
}

inline bool ClaimTestHookOnce(const char* env_var) {
  const char* path = TestHookValue(env_var);
  if (path == nullptr) return false;
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// RP_TEST_NODE_SUMS_ALONE=1: the workers of a one-node run sum their gradients, losses and eval
// losses across a group of that node alone (Gloo between CPU workers, NCCL between CUDA workers),
// as on several nodes, and with optimizer.state = "sharded" the node shards its state and gathers
// across that group too (ExecutionPlan::sharded_state), so the whole path runs on one machine and
// must change no bit.
inline bool TestNodeSumsAlone() {
  const char* v = TestHookValue("RP_TEST_NODE_SUMS_ALONE");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

// RP_TEST_LATE_COMPLETION_MS=<ms>: a CPU worker's device reports each microbatch complete, and
// each sum of gradient squares written, only that long after it was enqueued, as a GPU would
// while the host runs ahead, so the worker's bookkeeping of work in flight runs in CI. 0 when
// unset.
inline double TestLateCompletionSeconds() {
  const char* v = TestHookValue("RP_TEST_LATE_COMPLETION_MS");
  return v == nullptr ? 0.0 : std::strtod(v, nullptr) * 1e-3;
}

// RP_TEST_DEVICE_HANG_ONCE=<marker path>: in one worker of the run, a CPU device stops
// completing work at its 20th microbatch, as a stuck kernel would (the process stays alive and
// its loop keeps running).
inline bool TestDeviceHangOnce() { return ClaimTestHookOnce("RP_TEST_DEVICE_HANG_ONCE"); }

// RP_TEST_DEVICE_UPDATE_NUDGE=1: the weights a worker's device update computes
// (optimizer.device_update_blocks) are scaled by 1 + 2^-7 before any stage uses them, so a test can
// see that forward stages did use them (the run's losses then leave the host-updated run's).
inline bool TestDeviceUpdateNudge() {
  const char* v = TestHookValue("RP_TEST_DEVICE_UPDATE_NUDGE");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

// RP_TEST_ALWAYS_REPLAN (any value): every profile of an auto-partitioned run asks for a re-plan,
// as profiles too noisy to agree would (the launcher's limit on re-plans).
inline bool TestAlwaysReplan() { return TestHookValue("RP_TEST_ALWAYS_REPLAN") != nullptr; }
// RP_TEST_REPLAN_ONCE=<marker path>: the run's first profile asks for a re-plan whatever it
// predicts (ClaimTestHookOnce), so a test of the re-plan mechanics does not depend on which plan
// a noisy profile favours; later profiles decide as usual.
inline bool TestReplanOnce() { return ClaimTestHookOnce("RP_TEST_REPLAN_ONCE"); }

// RP_TEST_SLOW_FROM_STEP="<step>:<ms>": every microbatch of step >= <step> (0-based) takes <ms>
// milliseconds longer, in every worker: a machine that slowed down mid-run (the drift test).
// Returns the extra seconds for a microbatch of `step`; 0 when the variable is unset.
inline double TestSlowdownSeconds(int64_t step) {
  const char* v = TestHookValue("RP_TEST_SLOW_FROM_STEP");
  if (v == nullptr) return 0.0;
  char* end = nullptr;
  const long long from = std::strtoll(v, &end, 10);
  if (end == nullptr || *end != ':') return 0.0;
  const double ms = std::strtod(end + 1, nullptr);
  return step >= from && ms > 0 ? ms * 1e-3 : 0.0;
}

// RP_TEST_SLOW_EVAL_MS="<ms>": every eval job takes <ms> milliseconds longer (widens the window
// in which later steps' gradients complete while an evaluation is pending). 0 when unset.
inline double TestEvalDelaySeconds() { return DelaySecondsFromEnv("RP_TEST_SLOW_EVAL_MS"); }

// RP_TEST_SLOW_CHECKPOINT_MS="<ms>": the coordinator takes <ms> milliseconds longer over each
// training-state checkpoint write (on its loop, or on the background writer's thread), as a slow
// disk would. 0 when unset.
// RP_TEST_CHECKPOINT_ON_LOOP=1: checkpoints are written on the coordinator's loop even where a
// copy for a background write would fit (what a host short of memory does).
inline bool TestCheckpointOnLoop() {
  return TestHookValue("RP_TEST_CHECKPOINT_ON_LOOP") != nullptr;
}

inline double TestCheckpointDelaySeconds() {
  return DelaySecondsFromEnv("RP_TEST_SLOW_CHECKPOINT_MS");
}

// RP_TEST_NAN_AT_STEP="<step>": the loss scale of every microbatch of that step (0-based) is NaN
// in the workers and rp-train-ref, so its gradients are: a run that diverges. -1 when unset.
inline int64_t TestNanStep() {
  const char* v = TestHookValue("RP_TEST_NAN_AT_STEP");
  return v == nullptr ? -1 : std::strtoll(v, nullptr, 10);
}

// RP_TEST_OVERFLOW_AT_STEPS="<step>,<step>,...": the loss scale of every microbatch of those steps
// (0-based) is infinite in the workers, so their gradients are not finite: what an fp16 overflow
// does (an fp16 run skips exactly those steps; any other run diverges there).
inline bool TestOverflowAt(int64_t step) {
  const char* v = TestHookValue("RP_TEST_OVERFLOW_AT_STEPS");
  if (v == nullptr) return false;
  for (const char* p = v; *p != '\0';) {
    char* end = nullptr;
    const long long s = std::strtoll(p, &end, 10);
    if (end == p) return false;
    if (s == step) return true;
    p = *end == ',' ? end + 1 : end;
  }
  return false;
}

// RP_TEST_SLOW_FILL_MS="<ms>": the coordinator takes <ms> milliseconds longer to fill the run's
// shared state, as a large model's initialization or checkpoint read would. 0 when unset.
inline double TestFillDelaySeconds() { return DelaySecondsFromEnv("RP_TEST_SLOW_FILL_MS"); }

// RP_TEST_POISON_CHECKPOINT="<step>:<layer>": once a forward stage of that step (0-based) has
// written the checkpoint a backward stage starting at pipeline layer <layer> reads (a host
// activation slot inside the forward stage, not its output), the coordinator adds 1 to every
// element of it (fp32 activations), so a run whose backward really reads its checkpoints from host
// memory computes other gradients from that step on. {-1, -1} when unset.
struct PoisonedCheckpoint {
  int64_t step = -1;
  int layer = -1;
};
inline PoisonedCheckpoint TestPoisonedCheckpoint() {
  const char* v = TestHookValue("RP_TEST_POISON_CHECKPOINT");
  PoisonedCheckpoint p;
  if (v == nullptr) return p;
  char* end = nullptr;
  p.step = std::strtoll(v, &end, 10);
  p.layer = *end == ':' ? static_cast<int>(std::strtol(end + 1, nullptr, 10)) : -1;
  return p;
}

// RP_TEST_WELCOME_TIMEOUT_S="<s>": a worker waits that long for the coordinator's Welcome instead
// of its --hello-timeout-s (so a test of a slow fill needs no minutes-long wait). -1 when unset.
inline int TestWelcomeTimeoutSeconds() {
  const char* v = TestHookValue("RP_TEST_WELCOME_TIMEOUT_S");
  return v == nullptr ? -1 : static_cast<int>(std::strtol(v, nullptr, 10));
}

}  // namespace rp
