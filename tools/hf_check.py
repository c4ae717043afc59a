#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the project's Hugging Face export and model math against `transformers`.

    tools/hf_check.py BUILD_DIR WORK_DIR [--cuda]

Needs Python with torch and transformers (the GPU host has them; CI does not). Steps:
  1. a small Qwen3-shaped job (tied embeddings, qk-norm) trains one step on CPU workers and
     exports the result with checkpoint.export_hf;
  2. rp-train-ref loads that export (model.path) and reports its step-1 loss on a fixed batch
     (data.format = "tokens", no shuffling: the batch is the first sequences of the file);
  3. transformers loads the same directory and computes the loss of the same batch;
  4. with --cuda, rp-launch does step 2 on a CUDA worker in bf16 and transformers in bf16.
Prints one JSON line with both losses and their relative differences; exits 1 when fp32 differs
by more than 1e-4 relative or bf16 by more than 2e-2.
"""
import argparse
import json
import os
import subprocess
import sys

import random
from array import array

VOCAB, SEQ, MB, MBS = 512, 64, 2, 2  # 4 sequences of 64 tokens
JOB = """
[job]
name = "hf-check"
output_dir = "{out}"
device = "{device}"
[model]
vocab_size = {vocab}
hidden_size = 128
intermediate_size = 256
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 32
qk_norm = true
tie_embeddings = true
rope_theta = 1000000.0
{path}
[data]
format = "tokens"
path = "{tokens}"
seq_len = {seq}
shuffle = false
[train]
steps = {steps}
seed = 7
microbatches = {mb}
accum_calls = 1
microbatch_size = {mbs}
dtype = "{dtype}"
[optimizer]
lr = {lr}
min_lr = 0.0
[schedule]
forward_stages = 1
backward_stages = 1
tail_blocks = 1
[checkpoint]
export_hf = "{export}"
{extra}
"""


def write_job(work, name, device, dtype, export="", model_path="", steps=1, lr=1e-2, extra=""):
    """Writes WORK/NAME.toml (the check's model on WORK/tokens.bin); `extra` is appended TOML."""
    path = f'path = "{model_path}"' if model_path else ""
    text = JOB.format(out=os.path.join(work, name), device=device, vocab=VOCAB, path=path,
                      tokens=os.path.join(work, "tokens.bin"), seq=SEQ, mb=MB, mbs=MBS,
                      dtype=dtype, export=export, steps=steps, lr=lr, extra=extra)
    job = os.path.join(work, name + ".toml")
    with open(job, "w") as f:
        f.write(text)
    return job


def write_tokens(work):
    """The fixed batch: step 1 reads the first MB * MBS windows (no shuffling)."""
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB) for _ in range(MB * MBS * SEQ * 4 + 1)]
    with open(os.path.join(work, "tokens.bin"), "wb") as f:
        array("H", tokens).tofile(f)  # uint16, native (little-endian) order like the reader
    with open(os.path.join(work, "tokens.bin.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": VOCAB}, f)
    return tokens


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"hf_check: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def first_loss(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def loss_of(model, tokens, device):
    """Mean token cross-entropy of a transformers (or peft) model on the fixed batch."""
    import torch
    n = MB * MBS
    ids = torch.tensor(tokens[: n * SEQ], dtype=torch.long, device=device).reshape(n, SEQ)
    labels = torch.tensor(tokens[1 : n * SEQ + 1], dtype=torch.long, device=device).reshape(n, SEQ)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           reduction="sum")
    return ce.item() / labels.numel()


def hf_loss(model_dir, tokens, device, dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    return loss_of(model, tokens, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--cuda", action="store_true", help="also compare bf16 on a CUDA worker")
    a = ap.parse_args()
    os.makedirs(a.work_dir, exist_ok=True)
    work = os.path.abspath(a.work_dir)
    tokens = write_tokens(work)
    bins = os.path.abspath(os.path.join(a.build_dir, "bin"))

    train = write_job(work, "train", "cpu", "fp32", export="hf")
    run([bins + "/rp-launch", "--gpus", "1", train])
    hf_dir = os.path.join(work, "train", "hf")
    ref = write_job(work, "ref", "cpu", "fp32", model_path=hf_dir)
    run([bins + "/rp-train-ref", ref])
    ours = first_loss(os.path.join(work, "ref"))
    import torch
    theirs = hf_loss(hf_dir, tokens, "cpu", torch.float32)
    result = {"fp32_ours": ours, "fp32_transformers": theirs, "fp32_rel_diff": abs(ours - theirs) / abs(theirs)}
    ok = result["fp32_rel_diff"] <= 1e-4
    if a.cuda:
        gpu = write_job(work, "gpu", "cuda", "bf16", model_path=hf_dir)
        run([bins + "/rp-launch", "--gpus", "1", gpu])
        ours16 = first_loss(os.path.join(work, "gpu"))
        theirs16 = hf_loss(hf_dir, tokens, "cuda", torch.bfloat16)
        result.update({"bf16_ours": ours16, "bf16_transformers": theirs16,
                       "bf16_rel_diff": abs(ours16 - theirs16) / abs(theirs16)})
        ok = ok and result["bf16_rel_diff"] <= 2e-2
    import transformers
    result["transformers_version"] = transformers.__version__
    result["torch_version"] = torch.__version__
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
