#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the project's expert adapters (lora.target_parameters) against Hugging Face `peft`.

    tools/moe_peft_check.py BUILD_DIR WORK_DIR

Needs Python with torch, transformers 5 and peft 0.19 or later. Steps:
  1. rp-launch trains adapters on q_proj, v_proj and both expert tensors of the tiny Qwen3-MoE
     fixture (tests/testdata/moe_peft_fixture/job.toml, CPU worker, fp32, 3 steps) and exports
     them (PEFT layout) and the merged model;
  2. rp-train-ref loads base + exported adapter (lora.init_from, lr = 0) and reports its loss on
     the fixture's batch; peft loads the same directory onto the same base
     (PeftModel.from_pretrained) and transformers loads the merged directory; all three losses are
     compared (transformers' objective: cross-entropy plus the weighted load-balancing loss).
Prints one JSON line; exits 1 when any two differ by more than 1e-5 relative.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_moe_fixtures import objective, read_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "testdata", "moe_peft_fixture")
BASE = os.path.join(ROOT, "tests", "testdata", "hf_fixtures", "qwen3_moe_aux")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"moe_peft_check: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def first(metrics, field="loss"):
    with open(metrics) as f:
        return json.loads(f.readline())[field]


def main():
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    bins = os.path.abspath(os.path.join(sys.argv[1], "bin"))
    work = os.path.abspath(sys.argv[2])
    job = os.path.join(FIXTURE, "job.toml")
    train = os.path.join(work, "train")
    run([bins + "/rp-launch", "--gpus", "1", job, "--set", "job.output_dir=" + train, "--set", "train.steps=3",
         "--set", "optimizer.lr=2e-2", "--set", "optimizer.min_lr=2e-2", "--set", 'lora.init_from=""',
         "--set", 'lora.export="adapter"', "--set", 'checkpoint.export_hf="merged"'])
    adapter = os.path.join(train, "adapter")
    run([bins + "/rp-train-ref", job, "--set", "job.output_dir=" + os.path.join(work, "ours"),
         "--set", f'lora.init_from="{adapter}"'])
    ours = first(os.path.join(work, "ours", "metrics.jsonl"))
    tokens = read_tokens(os.path.dirname(BASE))

    def base():
        return AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()

    peft_model = PeftModel.from_pretrained(base(), adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(train, "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        aux = bool(merged.config.output_router_logits)
        theirs = objective(peft_model, tokens, aux)[0].item()
        merged_loss = objective(merged, tokens, aux)[0].item()
        bare = objective(base(), tokens, aux)[0].item()
    worst = max(abs(ours - theirs) / abs(theirs), abs(merged_loss - theirs) / abs(theirs))
    print(json.dumps({"ours": ours, "peft": theirs, "merged_transformers": merged_loss, "base_alone": bare,
                      "worst_rel": worst, "trained_first_loss": first(os.path.join(train, "metrics.jsonl"))}))
    if abs(bare - theirs) / abs(theirs) < 1e-4:
        sys.exit("moe_peft_check: the trained adapter does not change the loss; nothing was checked")
    return 1 if worst > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
