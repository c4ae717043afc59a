#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-kernel profile of one decoder block and the LM head at a job's microbatch shape.

The worker computes with LibTorch's ATen ops; this script issues the same ATen ops in the same
order (model/transformer.cc: Block, HeadForwardBackward) from Python, so torch.profiler can say
where a microbatch's GPU time goes: matrix products against memory-bound elementwise kernels.
It is a measuring tool for the GPU host (torch with CUDA), not part of the runtime.

    python3 bench/kernel_profile.py [--batch 4] [--seq 2048] [--model qwen3-1.7b] [--json OUT]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {
    # hidden, intermediate, heads, kv heads, head_dim, vocab
    "qwen3-1.7b": (2048, 6144, 16, 8, 128, 151936),
    "qwen3-4b": (2560, 9728, 32, 8, 128, 151936),
}


def block_weights(h, inter, nh, nkv, d, dev, dt):
    def w(o, i):
        return (torch.randn(o, i, device=dev, dtype=dt) / i ** 0.5).requires_grad_(True)

    return {
        "input_norm": torch.ones(h, device=dev, dtype=dt, requires_grad=True),
        "q": w(nh * d, h), "k": w(nkv * d, h), "v": w(nkv * d, h), "o": w(h, nh * d),
        "q_norm": torch.ones(d, device=dev, dtype=dt, requires_grad=True),
        "k_norm": torch.ones(d, device=dev, dtype=dt, requires_grad=True),
        "post_norm": torch.ones(h, device=dev, dtype=dt, requires_grad=True),
        "gate": w(inter, h), "up": w(inter, h), "down": w(h, inter),
    }


def rope_tables(S, D, dev, dt, theta=1e6):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    cos = torch.cat([f, f], -1).cos().to(dev, dt)
    sin = torch.cat([-f.sin(), f.sin()], -1).to(dev, dt)
    return cos, sin


def block(w, x, nh, nkv, d, cos, sin, eps=1e-6):
    B, S, _ = x.shape
    h = F.rms_norm(x, (x.shape[-1],), w["input_norm"], eps)
    q = F.linear(h, w["q"]).view(B, S, nh, d)
    k = F.linear(h, w["k"]).view(B, S, nkv, d)
    v = F.linear(h, w["v"]).view(B, S, nkv, d)
    q = F.rms_norm(q, (d,), w["q_norm"], eps)
    k = F.rms_norm(k, (d,), w["k_norm"], eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = torch.addcmul(q * cos, torch.roll(q, d // 2, -1), sin)
    k = torch.addcmul(k * cos, torch.roll(k, d // 2, -1), sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
    a = a.transpose(1, 2).reshape(B, S, nh * d)
    x1 = x + F.linear(a, w["o"])
    h2 = F.rms_norm(x1, (x1.shape[-1],), w["post_norm"], eps)
    mlp = F.linear(F.silu(F.linear(h2, w["gate"])) * F.linear(h2, w["up"]), w["down"])
    return x1 + mlp


def head(lm_head, final_norm, x, labels, chunk, eps=1e-6):
    h = F.rms_norm(x, (x.shape[-1],), final_norm, eps)
    leaf = h.detach().requires_grad_(True)
    flat, fl = leaf.reshape(-1, h.shape[-1]), labels.reshape(-1)
    total = 0.0
    for c0 in range(0, flat.shape[0], chunk):
        logits = F.linear(flat[c0:c0 + chunk], lm_head).float()
        ce = F.cross_entropy(logits, fl[c0:c0 + chunk], reduction="sum")
        total += ce.item()
        (ce * 1e-4).backward()
    h.backward(leaf.grad)
    return total


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def kernel_table(fn, top):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + ev.device_time_total / 1e3, n + 1)
    out = sorted(rows.items(), key=lambda kv: -kv[1][0])
    return [{"kernel": k, "ms": round(v[0], 4), "calls": v[1]} for k, v in out[:top]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_profile.py: needs a CUDA device")
    hdim, inter, nh, nkv, d, vocab = SHAPES[a.model]
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w = block_weights(hdim, inter, nh, nkv, d, dev, dt)
    cos, sin = rope_tables(a.seq, d, dev, dt)
    x0 = torch.randn(a.batch, a.seq, hdim, device=dev, dtype=dt)

    def fwd():
        with torch.no_grad():
            block(w, x0, nh, nkv, d, cos, sin)

    def fwd_bwd():
        x = x0.detach().requires_grad_(True)
        y = block(w, x, nh, nkv, d, cos, sin)
        y.backward(torch.ones_like(y))

    lm = (torch.randn(vocab, hdim, device=dev, dtype=dt) / hdim ** 0.5).requires_grad_(True)
    fnorm = torch.ones(hdim, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, vocab, (a.batch, a.seq), device=dev)

    def head_fb():
        head(lm, fnorm, x0.detach(), labels, a.chunk)

    tokens = a.batch * a.seq
    params = sum(v.numel() for v in w.values())
    mm_flops = 2 * tokens * sum(w[k].numel() for k in ("q", "k", "v", "o", "gate", "up", "down"))
    attn_flops = 2 * 2 * a.batch * nh * a.seq * a.seq * d / 2  # causal: half of QK^T and PV
    res = {
        "model": a.model, "batch": a.batch, "seq": a.seq, "tokens": tokens, "block_params": params,
        "block_fwd_ms": timed(fwd, a.reps),
        "block_fwd_bwd_ms": timed(fwd_bwd, a.reps),
        "head_fwd_bwd_ms": timed(head_fb, a.reps),
        "block_fwd_floor_ms": (mm_flops + attn_flops) / 790e12 * 1e3,
        "head_floor_ms": 3 * 2 * tokens * vocab * hdim / 790e12 * 1e3,
        "kernels_block_fwd": kernel_table(fwd, 25),
        "kernels_block_fwd_bwd": kernel_table(fwd_bwd, 40),
        "kernels_head": kernel_table(head_fb, 25),
    }
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("kernels")}, indent=1))
    for k in ("kernels_block_fwd", "kernels_block_fwd_bwd", "kernels_head"):
        print(f"\n{k}:")
        for r in res[k]:
            print(f"  {r['ms']:8.3f} ms  {r['calls']:4d}  {r['kernel']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
