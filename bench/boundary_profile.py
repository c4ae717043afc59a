#!/usr/bin/env python3
"""Where a run's GPU idle time goes, from its trace.json: at the step boundary or inside steps.

    bench/boundary_profile.py OUTPUT_DIR [--skip N]

For every step after the first N (default 2: warm-up), per worker:
  busy      sum of its microbatch compute spans in the step
  idle      the step's span on that worker (first microbatch start to last end) minus busy,
            plus the gap before its first microbatch (from the previous step's last microbatch on
            any worker): what the bubble ratio counts
  boundary  the part of idle between the step's last gradient (the end of its last job) and the
            worker's first microbatch of the next step: in exact mode the optimizer's pause
and for the optimizer: last gradient -> first layer's update done -> last layer's update done.
Prints medians over steps as one JSON object.
"""
import json
import statistics
import sys


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    out_dir = args[0]
    skip = int(args[args.index("--skip") + 1]) if "--skip" in args else 2
    events = json.load(open(out_dir + "/trace.json"))["traceEvents"]
    jobs = [e for e in events if e.get("cat") == "job"]
    mbs = [e for e in events if e.get("cat") == "microbatch"]
    updates = [e for e in events if e.get("cat") == "optimizer"]
    step_of_job = {e["args"]["job_index"]: e["args"]["step"] for e in jobs}
    workers = sorted({e["pid"] for e in mbs})
    steps = sorted({e["args"]["step"] for e in jobs})
    per_step = []
    for t in steps[skip:-1]:
        mine = [m for m in mbs if step_of_job.get(m["args"]["job_index"]) == t]
        nxt = [m for m in mbs if step_of_job.get(m["args"]["job_index"]) == t + 1]
        if not mine or not nxt:
            continue
        last_grad = max(j["ts"] + j["dur"] for j in jobs if j["args"]["step"] == t)
        ups = [u for u in updates if u["args"]["step"] == t]
        row = {"step": t}
        if ups:
            row["first_update_done_ms"] = (min(u["ts"] + u["dur"] for u in ups) - last_grad) / 1e3
            row["last_update_done_ms"] = (max(u["ts"] + u["dur"] for u in ups) - last_grad) / 1e3
        w_rows = []
        for w in workers:
            a = sorted((m["ts"], m["ts"] + m["dur"]) for m in mine if m["pid"] == w)
            b = sorted(m["ts"] for m in nxt if m["pid"] == w)
            if not a or not b:
                continue
            busy = sum(e - s for s, e in a)
            span = a[-1][1] - a[0][0]
            boundary = max(0.0, b[0] - max(last_grad, a[-1][1]))
            w_rows.append({"busy_ms": busy / 1e3, "idle_in_step_ms": (span - busy) / 1e3, "boundary_ms": boundary / 1e3})
        row["workers"] = w_rows
        per_step.append(row)
    if not per_step:
        sys.exit("no complete steps after the first %d" % skip)

    def med(key, rows):
        vals = [r[key] for r in rows if key in r]
        return round(statistics.median(vals), 1) if vals else None

    flat = [w for r in per_step for w in r["workers"]]
    print(json.dumps({
        "steps": [r["step"] for r in per_step],
        "workers": len(workers),
        "median_busy_ms_per_worker": med("busy_ms", flat),
        "median_idle_in_step_ms_per_worker": med("idle_in_step_ms", flat),
        "median_boundary_idle_ms_per_worker": med("boundary_ms", flat),
        "median_first_update_done_after_last_grad_ms": med("first_update_done_ms", per_step),
        "median_last_update_done_after_last_grad_ms": med("last_update_done_ms", per_step),
    }))


if __name__ == "__main__":
    main()
