#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes tiny Hugging Face models of each supported family and RoPE variant, with what
transformers computes on them, as test data for the project's own model math.

    tools/make_hf_fixtures.py OUT_DIR

Needs torch and transformers. For each case it writes OUT_DIR/<case>/ with:
  * config.json and model.safetensors, saved by transformers' own save_pretrained (weights in
    bf16 to keep the files small; every value below is computed on those bf16 values in fp32);
  * expected.json: the mean next-token cross-entropy of the fixed batch (OUT_DIR/tokens.bin,
    the project's "tokens" data format, windows taken in order), the L2 norm of every parameter's
    gradient of that loss, and negative controls: the loss transformers computes with one thing
    changed (another RoPE base, default RoPE instead of the scaled one, biases dropped). A control
    must move the loss by at least 1e-3 relative, or the script fails: a fixture that cannot tell
    right from wrong proves nothing.
Weights are drawn larger than a fresh model's (std 0.1; q/k projections 0.25, q/k norms around 2;
norm weights around 1, biases std 0.5) so that attention depends on position strongly enough for
RoPE errors to show in the loss. Scaled
RoPE cases use sequences longer than original_max_position_embeddings.
"""
import json
import math
import os
import random
import sys
from array import array

VOCAB, SEQ, SEQS = 256, 64, 4
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=256, initializer_range=0.1)

# name -> (model_type, config keys, rope parameters, controls). A control is either
# ("rope", {rope parameters}) or ("no_bias", None).
CASES = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=True),
              {"rope_type": "default", "rope_theta": 1000000.0},
              {"wrong_base": ("rope", {"rope_type": "default", "rope_theta": 10000.0})}),
    "qwen3_yarn": ("qwen3", dict(tie_word_embeddings=False, max_position_embeddings=128),
                   {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 32},
                   {"default_rope": ("rope", {"rope_type": "default", "rope_theta": 10000.0})}),
    "llama3": ("llama", dict(tie_word_embeddings=False),
               {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
               {"default_rope": ("rope", {"rope_type": "default", "rope_theta": 500000.0}),
                "wrong_base": ("rope", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32})}),
    "llama_tied_linear": ("llama", dict(tie_word_embeddings=True),
                          {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                          {"default_rope": ("rope", {"rope_type": "default", "rope_theta": 10000.0})}),
    "llama_bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
                   {"rope_type": "default", "rope_theta": 10000.0},
                   {"no_bias": ("no_bias", None)}),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False),
              {"rope_type": "default", "rope_theta": 1000000.0},
              {"no_bias": ("no_bias", None),
               "wrong_base": ("rope", {"rope_type": "default", "rope_theta": 10000.0})}),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None),
                {"rope_type": "default", "rope_theta": 1000000.0},
                {"wrong_base": ("rope", {"rope_type": "default", "rope_theta": 10000.0})}),
}


def make_config(model_type, keys, rope):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, **{**SHAPE, **keys}, rope_parameters=dict(rope))
    got = getattr(cfg, "rope_parameters", None)
    if not got or got.get("rope_type") != rope["rope_type"] or got.get("rope_theta") != rope["rope_theta"]:
        sys.exit(f"make_hf_fixtures: {model_type}: transformers kept rope_parameters={got}, asked {rope}")
    cfg._attn_implementation = "eager"
    return cfg


def batch(tokens):
    import torch
    ids = torch.tensor(tokens[: SEQS * SEQ], dtype=torch.long).reshape(SEQS, SEQ)
    labels = torch.tensor(tokens[1: SEQS * SEQ + 1], dtype=torch.long).reshape(SEQS, SEQ)
    return ids, labels


def loss_of(model, tokens):
    import torch
    ids, labels = batch(tokens)
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(model_type, keys, rope, state=None):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(make_config(model_type, keys, rope)).float()
    if state is not None:
        model.load_state_dict(state)
    return model


def draw_weights(model):
    """Every parameter drawn in place from torch's generator, then rounded to bf16 (the values
    the file holds). Sharp attention (scores of a few units) makes every position count; norms
    around 1 (q/k norms around 2), biases std 0.5, mixture-of-experts routers std 0.4 (logits
    spread out, so that choices are clear): none of them trivial."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(2.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(0.25 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.4 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
            p.copy_(p.bfloat16().float())


def main():
    import torch
    import transformers
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    rng = random.Random(11)
    tokens = [rng.randrange(VOCAB) for _ in range(SEQS * SEQ + 1)]
    with open(os.path.join(out, "tokens.bin"), "wb") as f:
        array("H", tokens).tofile(f)
    with open(os.path.join(out, "tokens.bin.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": VOCAB}, f)
    torch.use_deterministic_algorithms(True)
    for case, (model_type, keys, rope, controls) in CASES.items():
        torch.manual_seed(sum(map(ord, case)))
        model = build(model_type, keys, rope)
        draw_weights(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        norms = {}
        for name, p in model.named_parameters():
            norms[name] = p.grad.double().norm().item()
        d = os.path.join(out, case)
        model.to(torch.bfloat16).save_pretrained(d)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        expected = {"loss": loss.item(), "grad_norms": norms, "controls": {},
                    "model_type": model_type, "transformers": transformers.__version__,
                    "torch": torch.__version__}
        for cname, (kind, arg) in controls.items():
            if kind == "rope":
                other = build(model_type, keys, arg, state)
            else:
                other = build(model_type, keys, rope, state)
                with torch.no_grad():
                    for n, p in other.named_parameters():
                        if n.endswith(".bias"):
                            p.zero_()
            with torch.no_grad():
                c = loss_of(other, tokens).item()
            rel = abs(c - expected["loss"]) / abs(expected["loss"])
            if rel < 1e-3:
                sys.exit(f"make_hf_fixtures: {case}: control {cname} moves the loss by {rel:.2e} only")
            expected["controls"][cname] = {"loss": c, "rel_diff": rel}
            if kind == "rope":
                expected["controls"][cname]["rope_parameters"] = arg
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1, sort_keys=True)
            f.write("\n")
        print(case, expected["loss"], {k: round(v["rel_diff"], 4) for k, v in expected["controls"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
