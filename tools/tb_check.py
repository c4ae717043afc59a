#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks a run's TensorBoard event files against its metrics.jsonl with TensorBoard's own reader
(EventAccumulator): every numeric field of every line is a scalar of the line's step, with the
line's value (as float32) and time, and no step appears twice.

    python3 tools/tb_check.py RUN_DIR      (needs the tensorboard package)
"""
import json
import math
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# The metrics.jsonl fields TensorBoard shows; each tag is "<group>/<field>".
FIELDS = ["loss", "eval_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "step_time_s",
          "bubble_ratio", "h2d_gb_per_s", "device_peak_gib", "host_gib"]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def main():
    run = sys.argv[1]
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
    acc = EventAccumulator(os.path.join(run, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    by_field = {}
    for tag in acc.Tags()["scalars"]:
        field = tag.split("/", 1)[1]
        if field in by_field:
            sys.exit(f"tb_check: two tags for {field}")
        by_field[field] = {}
        for e in acc.Scalars(tag):
            if e.step in by_field[field]:
                sys.exit(f"tb_check: {tag}: step {e.step} appears twice")
            by_field[field][e.step] = e
    checked = 0
    for line in lines:
        for field in FIELDS:
            v = line.get(field)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            e = by_field.get(field, {}).pop(line["step"], None)
            if e is None:
                sys.exit(f"tb_check: step {line['step']}: no {field} scalar")
            if not (e.value == f32(v) or (math.isnan(e.value) and math.isnan(v))):
                sys.exit(f"tb_check: step {line['step']}: {field} {e.value} in TensorBoard, {v} in metrics.jsonl")
            if e.wall_time != line["time"]:
                sys.exit(f"tb_check: step {line['step']}: wall time {e.wall_time}, metrics.jsonl time {line['time']}")
            checked += 1
    left = {f: sorted(s) for f, s in by_field.items() if s}
    if left:
        sys.exit(f"tb_check: scalars without a metrics.jsonl line: {left}")
    print(f"tb_check: {checked} scalars of {len(lines)} steps (steps {lines[0]['step']}..{lines[-1]['step']}) "
          f"agree; tags: {sorted(acc.Tags()['scalars'])}")


if __name__ == "__main__":
    main()
