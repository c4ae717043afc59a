#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Trains every transformers-saved fixture with the project and with live transformers + torch
AdamW side by side, and checks the project's exports and LoRA adapters in transformers and peft.

    tools/hf_train_check.py BUILD_DIR WORK_DIR [--fixtures DIR] [--steps N] [--device cuda|cpu]
                            [--lr LR] [--floor]

Needs Python with torch, transformers and peft (the GPU host has them; CI does not). For each
fixture directory (default tests/testdata/hf_fixtures; tools/make_hf_fixtures.py writes them):
  1. trajectories: rp-launch (one worker on --device) trains N steps (default 10) in fp32 and in
     bf16; transformers trains the same model on the same batches with torch.optim.AdamW
     (weight decay on matrices only, the project's warmup + cosine schedule, clip_grad_norm_,
     TF32 off; bf16 as autocast over fp32 parameters). Per-step relative loss differences must
     stay within 1e-5 (fp32) and 1e-2 (bf16). With --floor transformers also trains on the CPU:
     its distance from itself on the device is what rounding alone does to the trajectory. The
     fixtures' attention is deliberately sharp; at --lr 1e-2 that distance alone reaches ~2e-3
     by step 10 (H200, transformers 5.17), so the default peak rate is 1e-3;
  2. export: transformers loads the fp32 run's export (checkpoint.export_hf) and computes the
     loss of the first batch, which must match rp-train-ref's on the same directory (1e-5);
  3. LoRA: rp-launch trains adapters on every projection for 3 steps (fp32) and exports them in
     PEFT's layout and merged; rp-train-ref (base + adapter), peft (PeftModel.from_pretrained) and
     transformers (the merged directory) compute the first batch's loss: all within 1e-5.
Mixture-of-experts fixtures adapt the attention projections only in step 3 (adapters on experts
are not supported); with output_router_logits = true transformers' side adds the routers'
load-balancing loss per microbatch as the runtime does (mean_ce). --only NAME... checks the named
fixtures only.
Prints one JSON line per fixture and a summary line; exits 1 when any check fails.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
from array import array

SEQ, MB, MBS = 64, 2, 2  # a step: 2 microbatches of 2 sequences of 64 tokens
LR, MIN_LR, WARMUP, WD, B1, B2, EPS, CLIP = 1e-3, 1e-4, 2, 0.1, 0.9, 0.95, 1e-8, 1.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ALL[:4]  # mixture-of-experts fixtures: adapters on the experts are not supported


def write_tokens(work, vocab, steps):
    rng = random.Random(5)
    tokens = [rng.randrange(vocab) for _ in range(steps * MB * MBS * SEQ + 1)]
    with open(os.path.join(work, "tokens.bin"), "wb") as f:
        array("H", tokens).tofile(f)
    with open(os.path.join(work, "tokens.bin.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": vocab}, f)
    return tokens


def set_lr(lr):
    global LR, MIN_LR
    LR, MIN_LR = lr, lr / 10


def job(work, name, model, device, dtype, steps, lr=None, export="", lora="", init_from="", targets=ALL):
    """WORK/NAME.toml: the check's job on WORK/../tokens.bin, output in WORK/NAME."""
    lr = LR if lr is None else lr
    text = f"""[job]
name = "{name}"
output_dir = "{os.path.join(work, name)}"
device = "{device}"
[model]
path = "{model}"
[data]
format = "tokens"
path = "{os.path.join(os.path.dirname(work), 'tokens.bin')}"
seq_len = {SEQ}
shuffle = false
[train]
steps = {steps}
seed = 7
microbatches = {MB}
accum_calls = 1
microbatch_size = {MBS}
dtype = "{dtype}"
grad_clip = {CLIP}
[optimizer]
lr = {lr}
min_lr = {MIN_LR if lr else 0.0}
warmup_steps = {WARMUP}
weight_decay = {WD}
beta1 = {B1}
beta2 = {B2}
eps = {EPS}
[schedule]
forward_stages = 1
backward_stages = 1
tail_blocks = 1
[checkpoint]
export_hf = "{export}"
"""
    if lora:
        text += f'[lora]\nrank = 4\nalpha = 8\ntarget_modules = {json.dumps(targets)}\n'
        if init_from:
            text += f'init_from = "{init_from}"\n'
    path = os.path.join(work, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def lr_at(step, steps):
    """config/lr_schedule.h: linear warmup, then cosine to MIN_LR at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    decay = steps - WARMUP
    if decay <= 1:
        return LR
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * (step - WARMUP) / (decay - 1)))


def batch(tokens, step, device):
    import torch
    n = MB * MBS
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    ids = t[step * n * SEQ: (step + 1) * n * SEQ].reshape(n, SEQ)
    labels = t[step * n * SEQ + 1: (step + 1) * n * SEQ + 1].reshape(n, SEQ)
    return ids, labels


def mean_ce(model, ids, labels):
    """The step's objective: mean next-token cross-entropy over the step's tokens, plus, for a
    mixture of experts trained with the routers' load-balancing loss, router_aux_loss_coef x
    the mean over the step's microbatches of that loss (the runtime's definition: one forward of
    each microbatch, transformers' own aux_loss for it)."""
    import torch
    cfg = model.config
    if not getattr(cfg, "output_router_logits", False):
        logits = model(input_ids=ids).logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    total = 0.0
    for mb_ids, mb_labels in zip(ids.split(MBS), labels.split(MBS)):
        out = model(input_ids=mb_ids, output_router_logits=True)
        logits = out.logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb_labels.reshape(-1),
                                               reduction="sum")
        total = total + ce / labels.numel() + cfg.router_aux_loss_coef * out.aux_loss / MB
    return total


def transformers_trajectory(model_dir, tokens, steps, device, bf16):
    import torch
    from transformers import AutoModelForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(B1, B2), eps=EPS)
    out = []
    for s in range(steps):
        ids, labels = batch(tokens, s, device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = mean_ce(model, ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, steps)
        opt.step()
        out.append(loss.item())
    return out


def first_batch_loss(model, tokens):
    import torch
    ids, labels = batch(tokens, 0, next(model.parameters()).device)
    with torch.no_grad():
        return mean_ce(model.eval(), ids, labels).item()


def rel(a, b):
    return abs(a - b) / abs(b)


def check_fixture(name, fixture, work, bins, tokens, steps, device, floor):
    import torch
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    w = os.path.join(work, name)
    os.makedirs(w, exist_ok=True)
    r = {"fixture": name}
    with open(os.path.join(fixture, "config.json")) as f:
        cfg = json.load(f)
    targets = ATTENTION if cfg["model_type"] == "qwen3_moe" else ALL
    # 1. trajectories
    run([bins + "/rp-launch", "--gpus", "1", job(w, "fp32", fixture, device, "fp32", steps, export="hf")])
    run([bins + "/rp-launch", "--gpus", "1", job(w, "bf16", fixture, device, "bf16", steps)])
    for dtype, bf16, tol in (("fp32", False, 1e-5), ("bf16", True, 1e-2)):
        ours = losses(os.path.join(w, dtype))
        theirs = transformers_trajectory(fixture, tokens, steps, device, bf16)
        worst = max(rel(a, b) for a, b in zip(ours, theirs))
        r[dtype] = {"ours": ours, "transformers": theirs, "max_rel_diff": worst, "ok": worst <= tol and len(ours) == steps}
        if floor and device != "cpu":
            # The same library on the CPU: how far two correct fp32 (or bf16) implementations of
            # this training drift apart from rounding alone.
            cpu = transformers_trajectory(fixture, tokens, steps, "cpu", bf16)
            r[dtype]["transformers_cpu_vs_device_max_rel_diff"] = max(rel(a, b) for a, b in zip(cpu, theirs))
    # 2. the fp32 run's export in transformers against rp-train-ref on the same directory
    export = os.path.join(w, "fp32", "hf")
    run([bins + "/rp-train-ref", job(w, "export-ref", export, "cpu", "fp32", 1, lr=0.0)])
    ours = losses(os.path.join(w, "export-ref"))[0]
    theirs = first_batch_loss(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32), tokens)
    r["export"] = {"ours": ours, "transformers": theirs, "rel_diff": rel(ours, theirs), "ok": rel(ours, theirs) <= 1e-5}
    # 3. LoRA adapters in peft, and the merged export in transformers
    run([bins + "/rp-launch", "--gpus", "1", job(w, "lora", fixture, device, "fp32", 3, lr=2e-2, export="merged", lora=True,
                                 targets=targets)])
    adapter = os.path.join(w, "lora", "adapter")
    run([bins + "/rp-train-ref", job(w, "lora-ref", fixture, "cpu", "fp32", 1, lr=0.0, lora=True, init_from=adapter,
                              targets=targets)])
    ours = losses(os.path.join(w, "lora-ref"))[0]
    base = AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)
    base_loss = first_batch_loss(base, tokens)
    theirs = first_batch_loss(PeftModel.from_pretrained(base, adapter), tokens)
    merged = first_batch_loss(AutoModelForCausalLM.from_pretrained(os.path.join(w, "lora", "merged"),
                                                                   dtype=torch.float32), tokens)
    ok = rel(ours, theirs) <= 1e-5 and rel(merged, theirs) <= 1e-5 and rel(base_loss, theirs) > 1e-4
    r["lora"] = {"ours": ours, "peft": theirs, "merged_transformers": merged, "base": base_loss,
                 "rel_diff": rel(ours, theirs), "merged_rel_diff": rel(merged, theirs), "ok": ok}
    r["ok"] = all(r[k]["ok"] for k in ("fp32", "bf16", "export", "lora"))
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                       "tests", "testdata", "hf_fixtures"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lr", type=float, default=LR, help="peak learning rate (min_lr is a tenth)")
    ap.add_argument("--only", nargs="*", default=None, help="check these fixtures only")
    ap.add_argument("--floor", action="store_true",
                    help="also run transformers on the CPU: the drift rounding alone causes")
    a = ap.parse_args()
    set_lr(a.lr)
    import peft
    import torch
    import transformers
    work = os.path.abspath(a.work_dir)
    os.makedirs(work, exist_ok=True)
    fixtures = os.path.abspath(a.fixtures)
    names = sorted(d for d in os.listdir(fixtures) if os.path.isdir(os.path.join(fixtures, d)))
    names = [d for d in names if a.only is None or d in a.only]
    with open(os.path.join(fixtures, names[0], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tokens = write_tokens(work, vocab, a.steps)
    bins = os.path.abspath(os.path.join(a.build_dir, "bin"))
    results = []
    for name in names:
        try:
            r = check_fixture(name, os.path.join(fixtures, name), work, bins, tokens, a.steps, a.device, a.floor)
        except Exception as e:  # one family failing must not hide the others' results
            r = {"fixture": name, "ok": False, "error": str(e)[-3000:]}
        results.append(r)
        print(json.dumps(r), flush=True)
    summary = {"summary": True, "ok": all(r["ok"] for r in results), "fixtures": len(results),
               "steps": a.steps, "device": a.device, "lr": LR,
               "fp32_max_rel_diff": max((r["fp32"]["max_rel_diff"] for r in results if "fp32" in r), default=None),
               "bf16_max_rel_diff": max((r["bf16"]["max_rel_diff"] for r in results if "bf16" in r), default=None),
               "export_max_rel_diff": max((r["export"]["rel_diff"] for r in results if "export" in r), default=None),
               "lora_max_rel_diff": max((max(r["lora"]["rel_diff"], r["lora"]["merged_rel_diff"])
                                         for r in results if "lora" in r), default=None),
               "fp32_floor_max_rel_diff": max((r["fp32"].get("transformers_cpu_vs_device_max_rel_diff", 0)
                                               for r in results if "fp32" in r), default=None),
               "bf16_floor_max_rel_diff": max((r["bf16"].get("transformers_cpu_vs_device_max_rel_diff", 0)
                                               for r in results if "bf16" in r), default=None),
               "transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
