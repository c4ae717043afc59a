#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a worker's compute stream idles, from a Kineto trace (RP_TRACE_KERNELS, README).

    bench/kernel_gaps.py TRACE.json [--stream ID] [--top N]

Prints one JSON object:
  span_ms            first to last GPU activity in the trace
  streams            busy milliseconds per stream (kernels, copies and fills; overlaps merged)
  compute_stream     the stream with the most kernel time (or --stream)
  idle_ms            the compute stream's idle time within the span, and by gap size
  host_late_ms       idle time whose next kernel was launched by the host after the gap began
                     (the device waited for the host: launch overhead, a host-side wait);
                     the rest waited on a dependency (an event on another stream: a copy)
  top_gaps           the longest gaps: when, how long, the kernels before and after, whether
                     the host was late, and the copies running on other streams meanwhile
"""
import json
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def merged_busy(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    top = int(args[args.index("--top") + 1]) if "--top" in args else 12
    events = json.load(open(args[0]))["traceEvents"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"]
    if not gpu:
        sys.exit("no GPU activity in " + args[0])
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
    by_stream = defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream", -1)].append(e)
    kernel_time = {s: sum(e["dur"] for e in v if e["cat"] == "kernel") for s, v in by_stream.items()}
    compute = int(args[args.index("--stream") + 1]) if "--stream" in args else max(kernel_time, key=kernel_time.get)
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    mine = sorted(by_stream[compute], key=lambda e: e["ts"])
    others = [e for s, v in by_stream.items() if s != compute for e in v]
    gaps = []
    end = mine[0]["ts"] + mine[0]["dur"]
    prev = mine[0]
    for e in mine[1:]:
        if e["ts"] > end:
            launched = launches.get(e["args"].get("correlation"))
            gaps.append({"start": end, "ms": (e["ts"] - end) / 1e3, "before": prev["name"][:90],
                         "after": e["name"][:90],
                         "host_late": launched is not None and launched > end})
        if e["ts"] + e["dur"] > end:
            end = e["ts"] + e["dur"]
            prev = e
    buckets = {"<0.05": 0.0, "0.05-0.2": 0.0, "0.2-1": 0.0, "1-5": 0.0, ">5": 0.0}
    for g in gaps:
        ms = g["ms"]
        key = "<0.05" if ms < 0.05 else "0.05-0.2" if ms < 0.2 else "0.2-1" if ms < 1 else "1-5" if ms < 5 else ">5"
        buckets[key] += ms
    longest = sorted(gaps, key=lambda g: -g["ms"])[:top]
    for g in longest:
        s, e = g["start"], g["start"] + g["ms"] * 1e3
        g["during"] = sorted({o["name"][:40] + " s" + str(o["args"].get("stream")) for o in others
                              if o["ts"] < e and o["ts"] + o["dur"] > s})[:6]
        g["at_ms"] = round((s - t0) / 1e3, 3)
        g["ms"] = round(g["ms"], 3)
        del g["start"]
    print(json.dumps({
        "trace": args[0],
        "span_ms": round((t1 - t0) / 1e3, 3),
        "streams": {str(s): round(merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in v]) / 1e3, 3)
                    for s, v in sorted(by_stream.items(), key=lambda kv: str(kv[0]))},
        "compute_stream": compute,
        "compute_kernel_ms": round(kernel_time[compute] / 1e3, 3),
        "idle_ms": round(sum(g["ms"] for g in gaps), 3),
        "gaps": len(gaps),
        "idle_ms_by_gap_ms": {k: round(v, 3) for k, v in buckets.items()},
        "host_late_ms": round(sum(g["ms"] for g in gaps if g["host_late"]), 3),
        "top_gaps": longest,
    }, indent=1))


if __name__ == "__main__":
    main()
