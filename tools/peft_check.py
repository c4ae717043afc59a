#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the project's LoRA adapters against Hugging Face `peft` (and writes a test fixture).

    tools/peft_check.py BUILD_DIR WORK_DIR [--cuda] [--fixture DIR]

Needs Python with torch, transformers and peft (the GPU host). Steps:
  1. the job's seeded base model is exported as an HF directory (rp-train-ref, lr = 0);
  2. rp-launch trains LoRA adapters on every projection (CPU worker, fp32) from that base and
     exports them (PEFT layout) and the merged model;
  3. rp-train-ref loads base + adapter (lora.init_from) and reports its loss on a fixed batch;
     transformers + peft load the same base and adapter directory (PeftModel.from_pretrained),
     and transformers loads the merged directory; all three losses are compared;
  4. with --cuda, rp-launch computes step 3 on a CUDA worker in bf16 against peft in bf16;
  5. with --fixture DIR, peft itself creates a random adapter (init_lora_weights=False) on that
     base, saves it with save_pretrained into DIR with the base (base/), the batch's tokens and
     its loss (expected.json): a fixture written by an independent tool, which the C++ tests load.
Prints one JSON line; exits 1 when fp32 differs by more than 1e-4 relative or bf16 by more than 2e-2.
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_check import first_loss, hf_loss, loss_of, run, write_job, write_tokens  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_section(rank, alpha, targets, init_from=""):
    s = f"[lora]\nrank = {rank}\nalpha = {alpha}\ntarget_modules = {json.dumps(targets)}\n"
    return s + (f'init_from = "{init_from}"\n' if init_from else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--cuda", action="store_true", help="also compare bf16 on a CUDA worker")
    ap.add_argument("--fixture", help="write a peft-made adapter fixture into this directory")
    a = ap.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model

    os.makedirs(a.work_dir, exist_ok=True)
    work = os.path.abspath(a.work_dir)
    tokens = write_tokens(work)
    bins = os.path.abspath(os.path.join(a.build_dir, "bin"))

    # lr = 0: the exported base is the seeded init; --fixture copies it into the fixture.
    run([bins + "/rp-train-ref", write_job(work, "base", "cpu", "fp32", export="hf", lr=0.0)])
    base = os.path.join(work, "base", "hf")
    train = write_job(work, "train", "cpu", "fp32", steps=3, lr=2e-2, export="merged", model_path=base,
                      extra=lora_section(4, 8, ALL))
    run([bins + "/rp-launch", "--gpus", "1", train])
    adapter = os.path.join(work, "train", "adapter")
    merged = os.path.join(work, "train", "merged")
    run([bins + "/rp-train-ref", write_job(work, "ours", "cpu", "fp32", model_path=base, lr=0.0,
                                            extra=lora_section(4, 8, ALL, adapter))])
    ours = first_loss(os.path.join(work, "ours"))

    def peft_model(dtype, device):
        m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=dtype).to(device)
        return PeftModel.from_pretrained(m, adapter).to(device).eval()

    theirs = loss_of(peft_model(torch.float32, "cpu"), tokens, "cpu")
    merged_loss = hf_loss(merged, tokens, "cpu", torch.float32)
    base_loss = hf_loss(base, tokens, "cpu", torch.float32)
    r = {"fp32_ours": ours, "fp32_peft": theirs, "fp32_rel_diff": abs(ours - theirs) / theirs,
         "fp32_merged_transformers": merged_loss, "merged_rel_diff": abs(merged_loss - theirs) / theirs,
         "base_loss": base_loss}
    ok = r["fp32_rel_diff"] <= 1e-4 and r["merged_rel_diff"] <= 1e-4 and abs(base_loss - theirs) > 1e-3
    if a.cuda:
        gpu = write_job(work, "gpu", "cuda", "bf16", model_path=base, lr=0.0,
                        extra=lora_section(4, 8, ALL, adapter))
        run([bins + "/rp-launch", "--gpus", "1", gpu])
        ours16 = first_loss(os.path.join(work, "gpu"))
        theirs16 = loss_of(peft_model(torch.bfloat16, "cuda"), tokens, "cuda")
        r.update({"bf16_ours": ours16, "bf16_peft": theirs16, "bf16_rel_diff": abs(ours16 - theirs16) / theirs16})
        ok = ok and r["bf16_rel_diff"] <= 2e-2
    if a.fixture:
        # peft's own adapter: random A and B (init_lora_weights=False), saved by save_pretrained.
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        targets = ["q_proj", "v_proj", "down_proj"]
        pm = get_peft_model(m, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,
                                          init_lora_weights=False, task_type="CAUSAL_LM")).eval()
        fx = os.path.abspath(a.fixture)
        shutil.rmtree(fx, ignore_errors=True)
        pm.save_pretrained(os.path.join(fx, "adapter"))
        shutil.copytree(base, os.path.join(fx, "base"))
        for name in ("tokens.bin", "tokens.bin.json"):
            shutil.copy(os.path.join(work, name), os.path.join(fx, name))
        fixture_loss = loss_of(pm, tokens, "cpu")
        with open(os.path.join(fx, "expected.json"), "w") as f:
            json.dump({"loss": fixture_loss, "rank": 2, "alpha": 4, "target_modules": targets,
                       "peft": peft.__version__, "transformers": transformers.__version__,
                       "torch": torch.__version__,
                       "made_by": "tools/peft_check.py --fixture (peft save_pretrained on the "
                                  "seeded base in base/)"}, f, indent=2)
        r["fixture_loss"] = fixture_loss
    r.update({"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "ok": ok})
    print(json.dumps(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
