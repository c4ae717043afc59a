#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks an fp16 run's loss-scale sequence against torch.amp.GradScaler's own update.

    tools/grad_scaler_check.py METRICS_JSONL [--init 65536] [--growth-factor 2] [--backoff-factor 0.5]
                               [--growth-interval 2000] [--lag 0|1]

Needs Python with torch (the GPU host has it). Reads each step's "skipped" flag (the gradients
were not all finite) from metrics.jsonl and replays the flags through torch._amp_update_scale_,
the kernel GradScaler.update() runs, on a CUDA device when there is one; the scale it holds
before step s must be the "loss_scale" the run reports for step s (--lag 1 for stale1 runs, whose
step s computes with the scale after step s - 2). Prints one JSON line; exits 1 on a mismatch.
"""
import argparse
import json
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--init", type=float, default=65536.0)
    ap.add_argument("--growth-factor", type=float, default=2.0)
    ap.add_argument("--backoff-factor", type=float, default=0.5)
    ap.add_argument("--growth-interval", type=int, default=2000)
    ap.add_argument("--lag", type=int, default=0)
    a = ap.parse_args()
    steps = [json.loads(line) for line in open(a.metrics)]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    scale = torch.full((1,), a.init, dtype=torch.float32, device=dev)
    tracker = torch.zeros((1,), dtype=torch.int32, device=dev)
    after = []  # the scale after each step
    for s in steps:
        found_inf = torch.full((1,), 1.0 if s["skipped"] else 0.0, dtype=torch.float32, device=dev)
        torch._amp_update_scale_(scale, tracker, found_inf, a.growth_factor, a.backoff_factor, a.growth_interval)
        after.append(scale.item())
    mismatches = []
    init = float(torch.tensor(a.init, dtype=torch.float32))
    for i, s in enumerate(steps):
        j = i - 1 - a.lag
        want = init if j < 0 else after[j]
        if s["loss_scale"] != want:
            mismatches.append({"step": s["step"], "run": s["loss_scale"], "torch": want})
    print(json.dumps({"steps": len(steps), "skipped": sum(1 for s in steps if s["skipped"]),
                      "scales": [s["loss_scale"] for s in steps], "mismatches": mismatches, "device": dev}))
    return 1 if mismatches or not steps else 0


if __name__ == "__main__":
    sys.exit(main())
