#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The fine-tuning path end to end, on the transformers side (scripts/finetune_e2e.sh runs it).

    tools/finetune_check.py base TOKENIZER_DIR OUT   a tiny Qwen3 saved by transformers (bf16) with
                                                     that tokenizer, and chat data: OUT/base,
                                                     OUT/train.jsonl, OUT/eval.jsonl
    tools/finetune_check.py check OUT                loads what the runs exported and checks it
                                                     against transformers and PEFT; writes
                                                     OUT/check.json, exits 1 on a failed check

check reads OUT/full (a full fine-tune with checkpoint.export_hf = "hf", in the base's dtype) and
OUT/lora (LoRA with lora.export = "adapter" and checkpoint.export_hf = "merged" in float32), each with its metrics.jsonl whose
last line holds the eval loss on OUT/eval.bin, and OUT/eval.bin as tools/prepare_data.py wrote it.
"""
import json
import os
import random
import sys
from array import array

import torch


def chats(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        turns = [{"role": "user", "content": f"What is {a} plus {b}?"},
                 {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if rng.random() < 0.5:
            c = rng.randrange(10)
            turns += [{"role": "user", "content": f"And plus {c}?"},
                      {"role": "assistant", "content": f"Then it is {a + b + c}."}]
        out.append({"messages": turns})
    return out


def make_base(tokenizer_dir, out):
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    base = os.path.join(out, "base")
    model.save_pretrained(base)
    tok.save_pretrained(base)
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id,
                     do_sample=False, max_new_tokens=24).save_pretrained(base)
    for name, n, seed in (("train.jsonl", 600, 1), ("eval.jsonl", 40, 2)):
        with open(os.path.join(out, name), "w") as f:
            for c in chats(n, seed):
                f.write(json.dumps(c) + "\n")
    print("base:", base, sum(p.numel() for p in model.parameters()), "parameters")


def read_prepared(path):
    """(ids, mask) per record of a prepared token file."""
    side = json.load(open(path + ".json"))
    ids = array("H" if side["dtype"] == "uint16" else "I")
    ids.frombytes(open(path, "rb").read())
    offsets = array("Q")
    offsets.frombytes(open(path + ".docs", "rb").read())
    mask = open(path + ".mask", "rb").read()
    return [(list(ids[offsets[d]:offsets[d + 1]]), list(mask[offsets[d]:offsets[d + 1]]))
            for d in range(len(offsets) - 1)]


def loss_on(model, records):
    """Mean cross-entropy over every target token of the records, each run alone (the run's eval
    loss: targets are the tokens whose mask is 1, predicted by the token before)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in records:
            x = torch.tensor([ids], device=model.device)
            logits = model(x).logits[0].float()
            labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask)], device=model.device)
            total += torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100,
                                                       reduction="sum").item()
            count += int((labels[1:] != -100).sum())
    return total / count


def last_eval_loss(run):
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    evals = [l for l in lines if l.get("eval_loss", -1) >= 0]
    return evals[-1]["eval_loss"]


def check(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from peft import PeftModel
    records = read_prepared(os.path.join(out, "eval.bin"))
    base_dir = os.path.join(out, "base")
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()  # noqa: E731
    result, failures = {}, []

    def expect(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what)

    base = load(base_dir)
    result["base_loss"] = loss_on(base, records)
    tok = AutoTokenizer.from_pretrained(base_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 plus 7?"}], tokenize=False,
                                     add_generation_prompt=True)
    for name, export in (("full", "full/hf"), ("lora", "lora/merged")):
        d = os.path.join(out, export)
        model = load(d)
        loss, run_loss = loss_on(model, records), last_eval_loss(os.path.join(out, name))
        result[name] = {"transformers_loss": loss, "run_eval_loss": run_loss,
                        "difference": abs(loss - run_loss), "below_base": result["base_loss"] - loss}
        expect(abs(loss - run_loss) <= 1e-3, f"{name}: transformers loss {loss:.6f} against the run's eval loss {run_loss:.6f}")
        expect(result["base_loss"] - loss >= 0.05, f"{name}: loss {loss:.4f} not 0.05 below the base's {result['base_loss']:.4f}")
        etok = AutoTokenizer.from_pretrained(d)
        expect(etok.get_vocab() == tok.get_vocab() and etok.chat_template == tok.chat_template,
               f"{name}: the export's tokenizer is the base's")
        g_base = GenerationConfig.from_pretrained(base_dir).to_dict()
        g_export = GenerationConfig.from_pretrained(d).to_dict()
        expect(g_base == g_export, f"{name}: generation_config {g_export} against {g_base}")
        cb, ce = json.load(open(os.path.join(base_dir, "config.json"))), json.load(open(os.path.join(d, "config.json")))
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            expect(cb.get(key) == ce.get(key), f"{name}: config {key} {ce.get(key)} against the base's {cb.get(key)}")
        # The full fine-tune is exported in the base's dtype (auto); the merged LoRA model in
        # float32, as its job asks, for the comparison with PEFT below.
        want = cb.get("dtype") if name == "full" else "float32"
        expect(ce.get("dtype") == want, f"{name}: config dtype {ce.get('dtype')}, expected {want}")
        x = etok(prompt, return_tensors="pt", add_special_tokens=False).to("cuda")
        generated = model.generate(**x, do_sample=False, max_new_tokens=24)
        result[name]["generated"] = etok.decode(generated[0, x["input_ids"].shape[1]:])
        print(f"{name}: transformers {loss:.5f}, run {run_loss:.5f}, base {result['base_loss']:.5f}; "
              f"generates {result[name]['generated']!r}")
    # PEFT's adapter on the base against the merged export. In fp32 (the bf16 base upcast exactly,
    # the merged model exported in float32) the adapter's layout, names and scale must give the
    # merged model's logits. In bf16 (reported, not checked) any two of the adapter on the bf16
    # base, PEFT's own merge_and_unload and our export differ by the bf16 rounding of W + BA and of
    # the arithmetic, far above 1e-3 at logits of a few units.
    compare = {}
    adapter = os.path.join(out, "lora", "adapter")
    for dtype in (torch.float32, torch.bfloat16):
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).cuda().eval(), adapter).eval()
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "lora", "merged"), dtype=dtype).cuda().eval()
        models = {"peft_adapter": peft_model}
        if dtype == torch.bfloat16:
            models["peft_merge_and_unload"] = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).cuda().eval(), adapter).merge_and_unload().eval()
        name = str(dtype).replace("torch.", "")
        for what, other in models.items():
            worst, scale = 0.0, 0.0
            with torch.no_grad():
                for ids, _ in records[:8]:
                    x = torch.tensor([ids], device="cuda")
                    a, b = other(x).logits.float(), merged(x).logits.float()
                    worst, scale = max(worst, (a - b).abs().max().item()), max(scale, b.abs().max().item())
            compare[f"{what}_{name}"] = {"max_abs_logit_difference": worst, "max_abs_logit": scale}
            print(f"{what} against our merged export in {name}: logits {worst:.3e} apart, largest {scale:.2f}")
    result["peft_vs_merged"] = compare
    worst = compare["peft_adapter_float32"]["max_abs_logit_difference"]
    expect(worst <= 1e-3, f"PEFT adapter against the merged export (fp32): logits {worst:.3e} apart")
    result["failures"] = failures
    with open(os.path.join(out, "check.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "base":
        make_base(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(check(sys.argv[2]))
