#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes tiny Qwen3-MoE models with what transformers computes on them, as test data for the
project's mixture-of-experts math.

    tools/make_moe_fixtures.py OUT_DIR

Needs torch and transformers. The batch is tools/make_hf_fixtures.py's (OUT_DIR/tokens.bin must
exist: run that script first on the same OUT_DIR). For each case it writes OUT_DIR/<case>/ with
config.json and model.safetensors saved by transformers' own save_pretrained (weights drawn as
make_hf_fixtures.py draws them, routers std 0.4; bf16 values, every figure below computed in
fp32 on them) and expected.json:
  * loss: what the model's training objective is on the batch: the mean next-token
    cross-entropy, plus router_aux_loss_coef x the load-balancing loss when the config's
    output_router_logits is true (transformers adds it exactly then); ce_loss and aux_loss apart;
  * grad_norms: the L2 norm of every parameter's gradient of that loss;
  * routing: per sparse layer (transformers' layer index), the experts each token chose, in
    order of probability, and min_gap: the smallest distance between a token's k-th and
    (k+1)-th router logit over every token and layer. Weights are redrawn until it is at least
    MIN_GAP, so rounding differences of the order of fp32's cannot flip a choice;
  * controls: the loss with one thing changed (norm_topk_prob flipped, the auxiliary loss
    dropped), each of which must move the loss by at least 1e-3 relative.
"""
import json
import os
import sys
from array import array

from make_hf_fixtures import draw_weights

VOCAB, SEQ, SEQS = 256, 64, 4
MIN_GAP = 2e-3
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=256, initializer_range=0.1, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

# name -> config keys. Sparse layers: transformers' rule, layer i is sparse unless it is in
# mlp_only_layers and when (i + 1) % decoder_sparse_step == 0.
CASES = {
    "qwen3_moe": dict(tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[1],
                      norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001),
    "qwen3_moe_aux": dict(tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=0.05),
}


def read_tokens(out):
    with open(os.path.join(out, "tokens.bin"), "rb") as f:
        a = array("H")
        a.frombytes(f.read())
    return list(a)


def build(keys, state=None, **over):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3_moe", **{**SHAPE, **keys, **over})
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).float()
    if state is not None:
        model.load_state_dict(state)
    return model


def objective(model, tokens, aux):
    """(total, ce, aux_loss, router logits per sparse layer)."""
    import torch
    ids = torch.tensor(tokens[: SEQS * SEQ], dtype=torch.long).reshape(SEQS, SEQ)
    labels = torch.tensor(tokens[1: SEQS * SEQ + 1], dtype=torch.long).reshape(SEQS, SEQ)
    out = model(input_ids=ids, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, VOCAB), labels.reshape(-1))
    total = ce + model.config.router_aux_loss_coef * out.aux_loss if aux else ce
    return total, ce, out.aux_loss, out.router_logits


def main():
    import torch
    import transformers
    out = os.path.abspath(sys.argv[1])
    tokens = read_tokens(out)
    torch.use_deterministic_algorithms(True)
    for case, keys in CASES.items():
        for attempt in range(200):
            torch.manual_seed(1000 * attempt + sum(map(ord, case)))
            model = build(keys)
            draw_weights(model)
            with torch.no_grad():
                _, _, _, logits = objective(model, tokens, False)
            k = SHAPE["num_experts_per_tok"]
            gaps = [(l.float().sort(-1, descending=True).values[:, k - 1] - l.float().sort(-1, descending=True).values[:, k]).min().item()
                    for l in logits]
            if min(gaps) >= MIN_GAP:
                break
        else:
            sys.exit(f"make_moe_fixtures: {case}: no draw with a router margin of {MIN_GAP}")
        state = {n: v.clone() for n, v in model.state_dict().items()}
        model.zero_grad()
        total, ce, aux, logits = objective(model, tokens, keys["output_router_logits"])
        total.backward()
        norms = {n: p.grad.double().norm().item() for n, p in model.named_parameters() if p.grad is not None}
        sparse = [i for i in range(SHAPE["num_hidden_layers"])
                  if i not in keys["mlp_only_layers"] and (i + 1) % keys["decoder_sparse_step"] == 0]
        routing = {str(i): l.float().topk(k, -1).indices.tolist() for i, l in zip(sparse, logits)}
        d = os.path.join(out, case)
        model.to(torch.bfloat16).save_pretrained(d)
        if os.path.exists(os.path.join(d, "generation_config.json")):
            os.remove(os.path.join(d, "generation_config.json"))
        expected = {"loss": total.item(), "ce_loss": ce.item(), "aux_loss": aux.item(),
                    "grad_norms": norms, "routing": routing, "min_gap": min(gaps), "attempt": attempt,
                    "controls": {}, "model_type": "qwen3_moe",
                    "transformers": transformers.__version__, "torch": torch.__version__}
        controls = {"flipped_norm_topk_prob": dict(norm_topk_prob=not keys["norm_topk_prob"])}
        if keys["output_router_logits"]:
            controls["no_aux_loss"] = dict(output_router_logits=False)
        for cname, over in controls.items():
            other = build(keys, state, **over)
            with torch.no_grad():
                c = objective(other, tokens, over.get("output_router_logits", keys["output_router_logits"]))[0].item()
            rel = abs(c - expected["loss"]) / abs(expected["loss"])
            if rel < 1e-3:
                sys.exit(f"make_moe_fixtures: {case}: control {cname} moves the loss by {rel:.2e} only")
            expected["controls"][cname] = {"loss": c, "rel_diff": rel, "config": over}
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1, sort_keys=True)
            f.write("\n")
        print(case, expected["loss"], expected["aux_loss"], "gap", min(gaps), "attempt", attempt,
              {k: round(v["rel_diff"], 4) for k, v in expected["controls"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
