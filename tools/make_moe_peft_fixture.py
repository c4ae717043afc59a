#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes a PEFT adapter on a tiny Qwen3-MoE model with adapters on the experts, as test data for
the project's expert LoRA (reader, layout, math).

    tools/make_moe_peft_fixture.py BASE_DIR OUT_DIR

Needs torch, transformers (5: fused expert tensors) and peft (LoraConfig.target_parameters).
BASE_DIR is a fixture of tools/make_moe_fixtures.py (config.json, model.safetensors; its parent
holds tokens.bin). peft itself creates a random adapter (init_lora_weights=False: every matrix
non-zero) on q_proj and v_proj (target_modules) and on every sparse block's
mlp.experts.gate_up_proj and mlp.experts.down_proj (target_parameters), saves it with
save_pretrained into OUT_DIR/adapter, and OUT_DIR/expected.json records, in fp32 on the fixture's
batch (the first 4 windows of 64 tokens):
  * loss, ce_loss, aux_loss: the training objective as transformers computes it (cross-entropy
    plus router_aux_loss_coef x the load-balancing loss when the config's output_router_logits);
  * grad_norm: the L2 norm over every adapter tensor's gradient of that loss; grad_norms per
    saved tensor name;
  * wrapped: for each saved module prefix of an expert adapter, the parameter it adapts (peft
    nests one wrapper per targeted parameter of a module; the names do not say which is which);
  * tensors: the saved names and shapes;
  * min_gap, attempt: the smallest distance between a token's k-th and (k+1)-th router logit
    with the adapters on (draws are repeated until it is at least MIN_GAP);
  * reload_loss: the loss after PeftModel.from_pretrained loads the saved directory;
  * controls: the loss with the expert adapters' lora_A rows read rank-major instead of
    expert-major, and without the expert adapters; each must move the loss by at least 1e-3
    relative, so a reader that gets the layout wrong fails.
"""
import json
import os
import sys

from make_moe_fixtures import objective, read_tokens

RANK, ALPHA = 2, 16
MIN_GAP = 2e-3
TARGET_MODULES = ["q_proj", "v_proj"]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def param_wrappers(model):
    from peft.tuners.lora.layer import ParamWrapper
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ParamWrapper)]


def main():
    import torch
    import transformers
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base_dir, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    tokens = read_tokens(os.path.dirname(base_dir))
    torch.use_deterministic_algorithms(True)

    def base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES,
                     target_parameters=TARGET_PARAMETERS, init_lora_weights=False)
    # The adapters change the hidden states the routers see: redraw them until every token's k-th
    # and (k+1)-th router logits are at least MIN_GAP apart, so rounding cannot flip a choice.
    for attempt in range(200):
        torch.manual_seed(29 + attempt)
        model = get_peft_model(base(), cfg)
        aux = bool(model.config.output_router_logits)
        k = model.config.num_experts_per_tok
        with torch.no_grad():
            logits = objective(model, tokens, aux)[3]
        top = [l.float().sort(-1, descending=True).values for l in logits]
        min_gap = min((t[:, k - 1] - t[:, k]).min().item() for t in top)
        if min_gap >= MIN_GAP:
            break
    else:
        sys.exit(f"make_moe_peft_fixture: no adapter draw with a router margin of {MIN_GAP}")
    model.zero_grad()
    total, ce, aux_loss, _ = objective(model, tokens, aux)
    total.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    grad_norm = sum((g * g).sum().item() for g in grads.values()) ** 0.5

    adapter = os.path.join(out, "adapter")
    model.save_pretrained(adapter)
    # The base by its fixture name, not this machine's path to it.
    config_path = os.path.join(adapter, "adapter_config.json")
    with open(config_path) as f:
        adapter_config = json.load(f)
    adapter_config["base_model_name_or_path"] = os.path.basename(base_dir)
    with open(config_path, "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
        f.write("\n")
    for extra in ("README.md",):
        if os.path.exists(os.path.join(adapter, extra)):
            os.remove(os.path.join(adapter, extra))
    tensors = {}
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():
            tensors[k] = list(f.get_slice(k).get_shape())

    # Saved names drop the adapter name ("default"); map each live parameter to its saved name.
    def saved(name):
        return name.replace(".default", "")

    grad_norms = {saved(n): g.norm().item() for n, g in grads.items()}
    missing = sorted(set(grad_norms) - set(tensors))
    if missing:
        sys.exit(f"make_moe_peft_fixture: trained tensors not in the saved file: {missing}")
    wrapped = {saved(n): m.parameter_name for n, m in param_wrappers(model)}
    if sorted(set(wrapped.values())) != ["down_proj", "gate_up_proj"]:
        sys.exit(f"make_moe_peft_fixture: unexpected expert wrappers: {wrapped}")

    reloaded = PeftModel.from_pretrained(base(), adapter)
    with torch.no_grad():
        reload_loss = objective(reloaded, tokens, aux)[0].item()
    if abs(reload_loss - total.item()) > 1e-6 * abs(total.item()):
        sys.exit(f"make_moe_peft_fixture: reloaded loss {reload_loss} != {total.item()}")

    controls = {}
    experts = model.config.num_experts
    with torch.no_grad():
        saved_a = {}
        for n, m in param_wrappers(model):
            a = m.lora_A["default"].weight
            saved_a[n] = a.clone()
            # expert-major rows (e * r + k) read as rank-major (k * E + e)
            a.copy_(a.reshape(RANK, experts, -1).transpose(0, 1).reshape(a.shape))
        controls["lora_A_rank_major"] = objective(model, tokens, aux)[0].item()
        for n, m in param_wrappers(model):
            m.lora_A["default"].weight.copy_(saved_a[n])
            m.lora_B["default"].weight.zero_()
        controls["no_expert_adapters"] = objective(model, tokens, aux)[0].item()
    for name, c in controls.items():
        rel = abs(c - total.item()) / abs(total.item())
        if rel < 1e-3:
            sys.exit(f"make_moe_peft_fixture: control {name} moves the loss by {rel:.2e} only")
        controls[name] = {"loss": c, "rel_diff": rel}

    expected = {"loss": total.item(), "ce_loss": ce.item(), "aux_loss": aux_loss.item(),
                "grad_norm": grad_norm, "grad_norms": grad_norms, "wrapped": wrapped, "tensors": tensors,
                "reload_loss": reload_loss, "controls": controls, "min_gap": min_gap, "attempt": attempt, "rank": RANK, "alpha": ALPHA,
                "target_modules": TARGET_MODULES, "target_parameters": TARGET_PARAMETERS,
                "base": os.path.basename(base_dir), "peft": peft.__version__,
                "transformers": transformers.__version__, "torch": torch.__version__,
                "made_by": "tools/make_moe_peft_fixture.py (peft save_pretrained)"}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps({k: expected[k] for k in ("loss", "grad_norm", "wrapped", "controls", "min_gap", "attempt")}))
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
