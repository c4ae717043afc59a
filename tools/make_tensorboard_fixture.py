#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes tests/testdata/tensorboard: an event file written by TensorBoard's own writer, and
expected.json with the (step, wall_time, tag, value) of each scalar it holds. The C++ test reader
(tests/testing/event_file_reader.h) must read that file back exactly.

Needs the tensorboard package:  python3 tools/make_tensorboard_fixture.py OUT_DIR
"""
import json
import os
import sys

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/testdata/tensorboard"
    os.makedirs(out, exist_ok=True)
    # Values exactly representable in float32, so the JSON and the file agree bit for bit; steps
    # that need a multi-byte varint; a tag per group the runtime writes.
    scalars = [(1, 1765000000.25, "train/loss", 5.5), (1, 1765000000.25, "train/lr", 0.000030517578125),
               (2, 1765000001.5, "speed/tokens_per_s", 40960.0), (300, 1765000002.75, "eval/eval_loss", 2.125),
               (70000, 1765000003.0, "memory/host_gib", 17.75)]
    writer = EventFileWriter(out)
    for step, wall_time, tag, value in scalars:
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        writer.add_event(event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
    writer.close()
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump([{"step": s, "wall_time": w, "tag": t, "value": v} for s, w, t, v in scalars], f, indent=1)
        f.write("\n")
    print("wrote", sorted(os.listdir(out)))


if __name__ == "__main__":
    main()
