#!/usr/bin/env python3
"""Times the *published* Python RoundPipe (ITcarrot/RoundPipe @ e813c67) on this project's workloads.

    bench/published_roundpipe.py --roundpipe DIR --shape SHAPE --mode {async,sync} \
        --warmup 2 --steps 4 [--layers N] [--out FILE] [--tiny]

SHAPE: qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-32b-lora, qwen3-30b-a3b-lora, qwen3-30b-a3b-fullft (configs/SHAPE.toml).

The library is imported, unmodified, from --roundpipe DIR (a checkout of ITcarrot/RoundPipe at
e813c67; default $RP_PUBLISHED_DIR). Its model wrappers were written for transformers 4.x; for
5.x this runner adapts transformers around them before importing them (transformers5_compat and
model_compat below), without touching the library's files. The model is the job's
shape built by transformers (Qwen3Config / Qwen3MoeConfig, no checkpoint), on the meta device,
then materialized module by module as the library's benchmark/train*.py do (to_empty on the GPU,
reset_parameters, then into host memory in bf16), with every weight set explicitly afterwards:
Linear/Embedding/router/expert tensors N(0, 0.02), RMSNorm weights 1, rotary inv_freq recomputed,
LoRA A kaiming-uniform and B zero (PEFT's default). For qwen3-32b-lora, PEFT LoRA r=16 on all seven
projections of every block. For qwen3-30b-a3b-lora, PEFT LoRA r=16 on the
attention projections and (target_parameters) on both fused expert tensors, base frozen; the
dense shapes and qwen3-30b-a3b-fullft are full fine-tunes. Optimizer: the library's CPU Adam on fp32 masters, constant lr,
clip_grad_norm_ inside the step function (the library's documented way); --mode async/sync is
model.step(..., is_async=True/False).

Prints one JSON line (and appends it to --out). Exits 2 if a loss is not finite or the first loss is
off the value a random-init model must give.

Extra modes (no GPU needed, for checking the model path): --build-only [--init-device cpu]
builds + materializes (+ PEFT) and exits; --check-forward additionally runs one forward through
the library's own Qwen3 prefix / layer / postfix modules (no RoundPipe runtime, torch.compile off)
and compares its loss with transformers' own forward. Use these with --tiny.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM = "published RoundPipe e813c67"
INIT_STD = 0.02

# The workloads of configs/<shape>.toml (cross-checked against the files when they are found).
SHAPES = {
    "qwen3-1.7b": dict(
        vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=True, moe=None,
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=2, lr=1e-5, grad_clip=1.0,
        seed=1, lora=None,
    ),
    "qwen3-4b": dict(
        vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=True, moe=None,
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=1, lr=1e-5, grad_clip=1.0,
        seed=1, lora=None,
    ),
    "qwen3-8b": dict(
        vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=False, moe=None,
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=1, lr=1e-5, grad_clip=0.0,
        seed=1, lora=None,
    ),
    "qwen3-32b-lora": dict(
        vocab=151936, hidden=5120, intermediate=25600, layers=64, heads=64, kv_heads=8,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=False, moe=None,
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=1, lr=2e-4, grad_clip=0.0,
        seed=1,
        lora=dict(
            r=16, alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"],
            target_parameters=[],
        ),
    ),
    "qwen3-30b-a3b-lora": dict(
        vocab=151936, hidden=2048, intermediate=6144, layers=48, heads=32, kv_heads=4,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=False,
        moe=dict(num_experts=128, top_k=8, moe_intermediate=768, norm_topk_prob=True),
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=1, lr=1e-4, grad_clip=1.0,
        seed=1,
        lora=dict(
            r=16, alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    ),
    "qwen3-30b-a3b-fullft": dict(
        vocab=151936, hidden=2048, intermediate=6144, layers=13, heads=32, kv_heads=4,
        head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, tie=False,
        moe=dict(num_experts=128, top_k=8, moe_intermediate=768, norm_topk_prob=True),
        seq=2048, microbatch_size=4, microbatches=4, accum_calls=1, lr=1e-5, grad_clip=0.0,
        seed=1, lora=None,
    ),
}


def fail(msg, code=2):
    sys.stdout.flush()
    print(f"published_roundpipe: ABORT: {msg}", file=sys.stderr, flush=True)
    os._exit(code)  # RoundPipe's device/optimizer threads need no orderly shutdown here


def log(msg):
    print(f"[published_roundpipe] {msg}", file=sys.stderr, flush=True)


def tiny_shape(s):
    s = dict(s)
    s.update(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, seq=256)
    if s["moe"]:
        s["moe"] = dict(s["moe"], num_experts=8, top_k=2, moe_intermediate=64)
    return s


def ensure_library_deps():
    """RoundPipe imports beartype (runtime type checks that only warn) and py-cpuinfo (a cache key
    for its JIT-built Adam). Where the host lacks them, stand-ins keep the library importable:
    beartype off (as the library itself does for beartype < 0.23), CPU flags from /proc/cpuinfo.
    Returns the names that were stood in for."""
    import importlib.metadata
    import shutil
    import types

    shimmed = []
    try:
        import beartype  # noqa: F401
    except ImportError:
        bt = types.ModuleType("beartype")
        bt.BeartypeConf = lambda *a, **k: None
        claw = types.ModuleType("beartype.claw")
        claw.beartype_this_package = lambda *a, **k: None
        roar = types.ModuleType("beartype.roar")
        roar.BeartypeDecorHintPep585DeprecationWarning = type(
            "BeartypeDecorHintPep585DeprecationWarning", (UserWarning,), {})
        bt.claw, bt.roar = claw, roar
        sys.modules.update({"beartype": bt, "beartype.claw": claw, "beartype.roar": roar})
        real_version = importlib.metadata.version

        def version(name):
            return "0.0.0" if name == "beartype" else real_version(name)

        importlib.metadata.version = version
        shimmed.append("beartype")
    try:
        import cpuinfo  # noqa: F401
    except ImportError:
        ci = types.ModuleType("cpuinfo")

        def get_cpu_info():
            flags = []
            try:
                with open("/proc/cpuinfo") as f:
                    for line in f:
                        if line.startswith("flags"):
                            flags = line.split(":", 1)[1].split()
                            break
            except OSError:
                pass
            return {"flags": flags}

        ci.get_cpu_info = get_cpu_info
        sys.modules["cpuinfo"] = ci
        shimmed.append("cpuinfo")
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package ships the binary

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except Exception:
            log("warning: no ninja on PATH; the library's Adam JIT build will fail")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        log("warning: no C++ compiler on PATH; the library's Adam JIT build will fail")
    if shimmed:
        log(f"stand-ins for missing modules: {shimmed}")
    return shimmed


def cross_check_toml(shape_name, s, configs_dir):
    path = os.path.join(configs_dir, f"{shape_name}.toml")
    if not os.path.exists(path):
        log(f"note: {path} not found; using the built-in shape without cross-check")
        return None
    import tomllib

    with open(path, "rb") as f:
        c = tomllib.load(f)
    m, t, o, d = c["model"], c["train"], c["optimizer"], c["data"]
    want = {
        "vocab": m["vocab_size"], "hidden": m["hidden_size"],
        "intermediate": m["intermediate_size"], "layers": m["num_layers"],
        "heads": m["num_heads"], "kv_heads": m["num_kv_heads"], "head_dim": m["head_dim"],
        "rope_theta": float(m["rope_theta"]), "rms_eps": float(m["rms_norm_eps"]),
        "tie": bool(m["tie_embeddings"]), "seq": d["seq_len"],
        "microbatch_size": t["microbatch_size"], "microbatches": t["microbatches"],
        "accum_calls": t["accum_calls"], "lr": float(o["lr"]),
        "grad_clip": float(t.get("grad_clip", 0.0)), "seed": t.get("seed", 1),
    }
    bad = [f"{k}: built-in {s[k]!r} vs toml {v!r}" for k, v in want.items() if s[k] != v]
    if "num_experts" in m:
        mo = s["moe"] or {}
        for k, v in (("num_experts", m["num_experts"]), ("top_k", m["experts_per_token"]),
                     ("moe_intermediate", m["expert_intermediate_size"]),
                     ("norm_topk_prob", bool(m.get("norm_topk_prob", False)))):
            if mo.get(k) != v:
                bad.append(f"moe.{k}: built-in {mo.get(k)!r} vs toml {v!r}")
    elif s["moe"]:
        bad.append("toml has no experts but the built-in shape does")
    if "lora" in c:
        lo, l = s["lora"] or {}, c["lora"]
        for k, v in (("r", l["rank"]), ("alpha", l["alpha"]),
                     ("target_modules", list(l.get("target_modules", []))),
                     ("target_parameters", list(l.get("target_parameters", [])))):
            if lo.get(k) != v:
                bad.append(f"lora.{k}: built-in {lo.get(k)!r} vs toml {v!r}")
    elif s["lora"]:
        bad.append("toml has no [lora] but the built-in shape does")
    if bad:
        fail(f"shape {shape_name} differs from {path}: " + "; ".join(bad))
    return path


def build_config(s):
    from transformers import Qwen3Config, Qwen3MoeConfig

    kw = dict(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rms_norm_eps=s["rms_eps"],
        tie_word_embeddings=s["tie"], max_position_embeddings=40960, hidden_act="silu",
        attention_bias=False, use_cache=False, use_sliding_window=False,
    )
    cls = Qwen3Config
    if s["moe"]:
        cls = Qwen3MoeConfig
        kw.update(
            num_experts=s["moe"]["num_experts"], num_experts_per_tok=s["moe"]["top_k"],
            moe_intermediate_size=s["moe"]["moe_intermediate"],
            norm_topk_prob=s["moe"]["norm_topk_prob"], decoder_sparse_step=1, mlp_only_layers=[],
            output_router_logits=False,
        )
    try:  # transformers 5.x
        cfg = cls(rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]}, **kw)
    except TypeError:  # older releases
        cfg = cls(rope_theta=s["rope_theta"], **kw)
    for k, v in kw.items():
        if getattr(cfg, k, None) != v:
            try:
                setattr(cfg, k, v)
            except Exception:
                pass
        if getattr(cfg, k, None) != v:
            fail(f"{cls.__name__}.{k} is {getattr(cfg, k, None)!r}, wanted {v!r}")
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None)) if isinstance(rp, dict) else None
    if theta is None:
        theta = getattr(cfg, "rope_theta", None)
    rope_type = rp.get("rope_type", "default") if isinstance(rp, dict) else "default"
    if theta != s["rope_theta"] or rope_type != "default":
        fail(f"rope: theta {theta!r} type {rope_type!r}, wanted {s['rope_theta']} default")
    return cfg


def fresh_rotary_buffers(module, config):
    """The rotary module's own init computation, run on the CPU: returns {buffer: tensor}, scaling."""
    import torch

    cls = type(module)
    cfg = getattr(module, "config", None) or config
    fresh = None
    for kwargs in ({"config": cfg, "device": torch.device("cpu")}, {"config": cfg}):
        try:
            with torch.device("cpu"):
                fresh = cls(**kwargs)
            break
        except TypeError:
            continue
    if fresh is None:
        raise RuntimeError(f"cannot re-create {cls.__name__}")
    bufs = {n: b.detach().to(torch.float32) if b.is_floating_point() else b.detach()
            for n, b in fresh.named_buffers(recurse=False)}
    return bufs, getattr(fresh, "attention_scaling", None)


def materialize(model, init_device, dtype, std=INIT_STD):
    """Meta -> init_device (to_empty, reset_parameters, explicit init) -> host memory, per module."""
    import torch
    import torch.nn as nn

    stats = {"rmsnorm": 0, "rotary": 0, "linear_embedding": 0, "lora_A": 0, "lora_B": 0,
             "other_params": [], "zeroed_1d": [], "unknown_buffers": []}
    with torch.no_grad():
        for name, module in model.named_modules():
            module.to_empty(device=init_device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # as the library's benchmark/train*.py
            cls = type(module).__name__
            dotted = f".{name}."
            is_rotary = cls.endswith("RotaryEmbedding")
            if is_rotary:
                bufs, scaling = fresh_rotary_buffers(module, model.config)
                for bname, val in bufs.items():  # float32, as computed (the persistent flag is kept by name)
                    module._buffers[bname] = val.to(init_device)
                if scaling is not None:
                    module.attention_scaling = scaling
                stats["rotary"] += 1
            elif "RMSNorm" in cls or cls.endswith("LayerNorm"):
                for pname, p in module.named_parameters(recurse=False):
                    (p.fill_(1.0) if pname == "weight" else p.zero_())
                stats["rmsnorm"] += 1
            elif ".lora_A." in dotted:  # PEFT's default init: A kaiming-uniform, B zero
                for p in module.parameters(recurse=False):
                    nn.init.kaiming_uniform_(p, a=math.sqrt(5)) if p.ndim >= 2 else p.zero_()
                    stats["lora_A"] += 1
            elif ".lora_B." in dotted:
                for p in module.parameters(recurse=False):
                    p.zero_()
                    stats["lora_B"] += 1
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                stats["linear_embedding"] += 1
            else:  # routers (Qwen3MoeTopKRouter.weight), fused experts (gate_up_proj, down_proj), ...
                for pname, p in module.named_parameters(recurse=False):
                    if p.ndim >= 2:
                        p.normal_(0.0, std)
                        stats["other_params"].append(f"{name}.{pname}")
                    else:
                        p.zero_()
                        stats["zeroed_1d"].append(f"{name}.{pname}")
            if not is_rotary:
                for bname, _ in module.named_buffers(recurse=False):
                    stats["unknown_buffers"].append(f"{name}.{bname}")
            # Parameters to host memory in bf16; rotary tables stay float32.
            module._apply(
                lambda t: t.to(device="cpu", dtype=dtype)
                if (t.is_floating_point() and not is_rotary) else t.to(device="cpu"),
                recurse=False,
            )
            if is_rotary and "original_inv_freq" not in module._buffers and hasattr(module, "original_inv_freq"):
                module.original_inv_freq = module.inv_freq.clone()  # 4.x kept it as a plain attribute
    if init_device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    left = [n for n, p in model.named_parameters() if p.is_meta or p.device.type != "cpu"]
    left += [n for n, b in model.named_buffers() if b.is_meta or b.device.type != "cpu"]
    if left:
        fail(f"tensors not materialized in host memory: {left[:8]}")
    if stats["unknown_buffers"]:
        fail(f"buffers with no known init (would be garbage after to_empty): {stats['unknown_buffers'][:8]}")
    return stats


def retie(model):
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    emb = model.get_input_embeddings()
    model.lm_head.weight = emb.weight  # to_empty gave the two modules separate tensors
    assert model.lm_head.weight is emb.weight
    return True


def transformers5_compat():
    """Before the library's model wrappers are imported. transformers 5 renamed the mask builders'
    `input_embeds` keyword to `inputs_embeds` and rejects keywords its signature does not name;
    the wrappers import the builders by name, so they get these adapters. The Qwen3-MoE module may
    lack load_balancing_loss_func, which the wrapper imports but calls only with router logits."""
    import functools
    import inspect
    from transformers import masking_utils

    def adapt(fn):
        params = inspect.signature(fn).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

        @functools.wraps(fn)
        def call(*a, **kw):
            if "input_embeds" in kw and "input_embeds" not in params:
                kw["inputs_embeds"] = kw.pop("input_embeds")
            if not var_kw:
                kw = {k: v for k, v in kw.items() if k in params}
            return fn(*a, **kw)
        return call

    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        if not getattr(getattr(masking_utils, name), "_rp_adapted", False):
            f = adapt(getattr(masking_utils, name))
            f._rp_adapted = True
            setattr(masking_utils, name, f)
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as moe
    except ImportError:
        return
    if not hasattr(moe, "load_balancing_loss_func"):
        def no_aux_loss(*a, **k):
            raise NotImplementedError("router logits are not requested in these runs")
        moe.load_balancing_loss_func = no_aux_loss


def model_compat(model):
    """Attributes the library's wrappers read that transformers 5 models no longer carry; the
    shapes here have full attention only."""
    cfg = model.config
    if not hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None
    inner = model.model
    if not hasattr(inner, "has_sliding_layers"):
        inner.has_sliding_layers = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    for layer in inner.layers:
        if not hasattr(layer, "attention_type"):
            layer.attention_type = "full_attention"
        if not hasattr(layer, "hidden_size"):
            layer.hidden_size = cfg.hidden_size
    for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"):
        if hasattr(cfg, name) and not hasattr(model, name):
            setattr(model, name, getattr(cfg, name))


def build_model(s, args):
    import torch
    import transformers

    try:
        transformers.modeling_utils._init_weights = False  # as benchmark/train.py
    except Exception:
        pass
    config = build_config(s)
    config.use_cache = False
    try:
        config._attn_implementation = "sdpa"
    except Exception:
        pass
    extra = {"attn_implementation": "sdpa"}
    if args.experts_impl and s["moe"]:
        extra["experts_implementation"] = args.experts_impl
    lora_cfg = None
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **extra)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, **extra)
        want_cls = "Qwen3MoeForCausalLM" if s["moe"] else "Qwen3ForCausalLM"
        if type(model).__name__ != want_cls:
            fail(f"built {type(model).__name__}, wanted {want_cls}")
        if s["lora"]:
            from peft import LoraConfig, LoraModel

            lora_cfg = LoraConfig(
                r=s["lora"]["r"], lora_alpha=s["lora"]["alpha"], lora_dropout=0.0, bias="none",
                target_modules=list(s["lora"]["target_modules"]),
                target_parameters=list(s["lora"]["target_parameters"]) or None,
            )
            model = LoraModel(model, lora_cfg, "default").model  # as benchmark/train_lora.py
    init_device = torch.device(args.init_device)
    stats = materialize(model, init_device, torch.bfloat16)
    tied = retie(model)
    model_compat(model)
    if s["moe"]:
        wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
        if s["lora"] and len(wrapped) != 2 * s["layers"]:
            fail(f"expected {2 * s['layers']} PEFT ParamWrappers (two expert tensors per layer), found {len(wrapped)}")
    attn = getattr(model.config, "_attn_implementation", None)
    experts = getattr(model.config, "_experts_implementation", None)
    log(f"built {type(model).__name__}: attn={attn} experts={experts} tied={tied} init={ {k: (v if isinstance(v, int) else len(v)) for k, v in stats.items()} }")
    if stats["other_params"]:
        log(f"  N(0,{INIT_STD}) via the generic rule: {stats['other_params'][:4]}{' ...' if len(stats['other_params']) > 4 else ''}")
    return model, {"attn_implementation": attn, "experts_implementation": experts, "tied": tied,
                   "init_counts": {k: (v if isinstance(v, int) else len(v)) for k, v in stats.items()}}


def expected_first_loss(s):
    # Random-init model: the final RMSNorm gives unit-RMS hidden states, the head's weights are
    # N(0, std^2), so logits ~ N(0, H std^2) independent of the (random) label:
    # E[CE] = ln V + H std^2 / 2 (+0.41 for H=2048, +0.51 for H=2560).
    return math.log(s["vocab"]) + 0.5 * s["hidden"] * INIT_STD ** 2


def check_first_loss(s, loss):
    exp = expected_first_loss(s)
    if not math.isfinite(loss) or abs(loss - exp) > 0.5:
        fail(f"first loss {loss} is not within 0.5 of {exp:.4f} (ln V = {math.log(s['vocab']):.4f} "
             f"+ H*std^2/2): the model is not a sane random init")


def pinned_estimate(model, trainable):
    tot = 0
    for t in list(model.parameters()) + list(model.buffers()):
        n = t.numel() * t.element_size()
        tot += 1 << max(0, (n - 1).bit_length()) if n > 0 else 0
    return tot, trainable * 20  # masters 4 + Adam 8 + fp32 grads 4 + pinned bf16 grads ~2-4


def mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_forward(s, model, ids, mask):
    """CPU-capable check of the library's model wrappers against transformers' own forward."""
    import importlib
    import torch

    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        hf_loss = float(hf.loss)
        cls = type(model).__name__
        mod = importlib.import_module("roundpipe.models." + ("qwen3_moe" if s["moe"] else "qwen3"))
        prefix = getattr(mod, f"{cls}Prefix")(model)
        layers = [getattr(mod, f"{cls}WrappedLayer")(layer) for layer in model.model.layers]
        postfix = getattr(mod, f"{cls}Postfix")(model)
        x = prefix(input_ids=ids, attention_mask=mask, labels=ids, return_logits=False)
        for layer in layers:
            x = layer(x)
        rp_loss = float(postfix(x).loss)
    log(f"check-forward: transformers loss {hf_loss:.5f}, library wrappers {rp_loss:.5f}, "
        f"expected ~{expected_first_loss(s):.4f}")
    if not (math.isfinite(hf_loss) and math.isfinite(rp_loss)) or abs(hf_loss - rp_loss) > 0.02:
        fail("library wrapper loss differs from transformers' loss")
    check_first_loss(s, rp_loss)
    return hf_loss, rp_loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--mode", default="async", choices=["async", "sync"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, 8 experts of width 64, seq 256")
    ap.add_argument("--pin", default="auto", choices=["auto", "alloc", "register", "off"],
                    help="RoundPipe pin_model; auto = alloc (library default) unless host memory looks short, then register")
    ap.add_argument("--experts-impl", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                    help="transformers experts_implementation (default: transformers' choice)")
    ap.add_argument("--init-device", default="cuda", help="device for materializing weights (cpu for --build-only checks)")
    ap.add_argument("--build-only", action="store_true", help="build + materialize (+PEFT), report, exit")
    ap.add_argument("--check-forward", action="store_true", help="with --build-only: one forward via the library's wrappers vs transformers")
    ap.add_argument("--roundpipe", default=os.environ.get("RP_PUBLISHED_DIR"),
                    help="checkout of the published RoundPipe (e813c67), used as it is")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's block count (after the toml cross-check)")
    ap.add_argument("--configs-dir", default=os.path.join(HERE, "..", "configs"))
    ap.add_argument("--no-precompile", action="store_true", help="skip the loss-kernel precompile the library's benchmark does")
    args = ap.parse_args()

    s = dict(SHAPES[args.shape])
    toml_path = cross_check_toml(args.shape, s, args.configs_dir)
    if args.tiny:
        s = tiny_shape(s)
    if args.layers:
        s["layers"] = args.layers
    M, K, mbs, seq = s["microbatches"], s["accum_calls"], s["microbatch_size"], s["seq"]
    tokens_per_step = mbs * M * K * seq

    if args.check_forward:
        args.build_only = True
        os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")
    if not args.roundpipe or not os.path.isdir(os.path.join(args.roundpipe, "roundpipe")):
        fail("--roundpipe DIR (or RP_PUBLISHED_DIR) must name a checkout of the published RoundPipe")
    sys.path.insert(0, os.path.abspath(args.roundpipe))
    shimmed = ensure_library_deps()

    try:
        import torch
    except ImportError as e:
        fail(f"torch is needed: {e}")

    if not args.build_only and not torch.cuda.is_available():
        fail("CUDA is not available (use --build-only --init-device cpu for a CPU check)")
    try:
        import transformers
    except ImportError as e:
        fail(f"transformers is needed: {e}")
    transformers5_compat()
    peft_version = None
    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        if s["lora"]:
            fail("peft is needed for the LoRA shape")

    torch.manual_seed(s["seed"])
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s["seed"])
    t_build = time.perf_counter()
    model, build_info = build_model(s, args)
    build_s = time.perf_counter() - t_build
    model_params = sum(p.numel() for p in model.parameters())
    trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"model_params={model_params} trainable_params={trainable_params} build {build_s:.1f}s")

    g = torch.Generator().manual_seed(s["seed"])
    all_input = torch.randint(0, s["vocab"], (mbs * M * K, seq), generator=g)
    input_tensors = [t.contiguous() for t in all_input.chunk(K)]
    masks = [torch.ones_like(t) for t in input_tensors]

    if args.build_only:
        info = {"shape": args.shape, "tiny": args.tiny, "model_params": model_params,
                "trainable_params": trainable_params, **build_info}
        if args.check_forward:
            hf_loss, rp_loss = check_forward(s, model, input_tensors[0][:mbs], masks[0][:mbs])
            info.update(check_forward_hf_loss=hf_loss, check_forward_roundpipe_loss=rp_loss)
        print(json.dumps(info), flush=True)
        os._exit(0)

    try:
        from roundpipe import wrap_model_to_roundpipe, RoundPipeRunConfig
        from roundpipe.optim import Adam
    except ImportError as e:
        fail(f"cannot import the published RoundPipe from {args.roundpipe} (it needs beartype, "
             f"py-cpuinfo, ninja, tqdm, typing_extensions, and g++ for its Adam): {e}")

    pin, pin_reason = args.pin, "requested"
    if pin == "auto":
        pinned, optim_bytes = pinned_estimate(model, trainable_params)
        param_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        avail = mem_available()
        need = pinned - param_bytes + optim_bytes + (8 << 30)
        pin, pin_reason = "alloc", f"auto: ~{pinned / 2**30:.0f} GiB pinned + ~{optim_bytes / 2**30:.0f} GiB optimizer"
        if avail is not None and need > avail:
            pin = "register"
            pin_reason += f" > {avail / 2**30:.0f} GiB available: register instead of alloc"
        log(f"pin_model={pin} ({pin_reason})")

    lm_head = model.lm_head
    lm_in, lm_out, lm_bias = lm_head.in_features, lm_head.out_features, lm_head.bias is not None
    lm_trainable = lm_head.weight.requires_grad

    t_wrap = time.perf_counter()
    rp_model = wrap_model_to_roundpipe(
        model,
        optim_dtype=torch.float32,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=M),
        pin_model=pin,
    )
    optim = Adam(rp_model.optim_parameters(), lr=s["lr"])
    optim_params = [p for group in optim.param_groups for p in group["params"]]
    wrap_s = time.perf_counter() - t_wrap
    log(f"wrapped: {len(optim_params)} optimizer tensors, {sum(p.numel() for p in optim_params)} elements, {wrap_s:.1f}s")

    clip = s["grad_clip"]

    def step_fn():
        # Runs on RoundPipe's optimizer thread on the fp32 masters (training_loop docs).
        if clip and clip > 0:
            torch.nn.utils.clip_grad_norm_(optim_params, max_norm=clip)
        optim.step()
        optim.zero_grad()

    # The library's benchmark compiles its chunked linear+cross-entropy loss before training.
    from roundpipe.models import DISABLE_TORCH_COMPILE
    if not args.no_precompile and not DISABLE_TORCH_COMPILE:
        from roundpipe.device import device_list
        from roundpipe.models.function import ChunkedCompileLinearForCausalLMLoss

        t_pc = time.perf_counter()
        for device in device_list:
            head = torch.nn.Linear(lm_in, lm_out, lm_bias, device=device.device, dtype=torch.bfloat16)
            for p in head.parameters():
                p.requires_grad = lm_trainable
            hidden = torch.rand((mbs, seq, lm_in), dtype=torch.bfloat16, device=device.device, requires_grad=True)
            labels = torch.randint(0, s["vocab"], (mbs, seq), dtype=torch.long, device=device.device)
            with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                ChunkedCompileLinearForCausalLMLoss(hidden, head, labels)
            del head, hidden, labels
        torch.cuda.synchronize()
        log(f"loss kernel precompiled in {time.perf_counter() - t_pc:.1f}s")

    is_async = args.mode == "async"

    def train_step():
        total = 0.0
        for ids, mask in zip(input_tensors, masks):
            loss = rp_model.forward_backward(
                input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids, "return_logits": False},
                loss_fn=lambda outputs, _: outputs.loss / M / K,
            )
            total += float(loss)
        rp_model.step(step_fn, is_async=is_async)
        return total

    losses, warm_times, times = [], [], []
    torch.cuda.synchronize()
    t_prev = time.perf_counter()
    for i in range(args.warmup + args.steps):
        loss = train_step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        dt, t_prev = t - t_prev, t
        (warm_times if i < args.warmup else times).append(dt)
        losses.append(loss)
        log(f"step {i + 1}/{args.warmup + args.steps}{' (warm-up)' if i < args.warmup else ''}: "
            f"loss {loss:.5f}, {dt:.3f}s")
        if not math.isfinite(loss):
            fail(f"loss at step {i + 1} is {loss} (losses so far: {losses})")
        if i == 0:
            check_first_loss(s, loss)
    t0 = time.perf_counter()
    rp_model.optim_updated.wait()  # the last (asynchronous) optimizer step, not in the timed window
    drain_s = time.perf_counter() - t0

    timed = sum(times)
    result = {
        "system": SYSTEM,
        "shape": args.shape + ("-tiny" if args.tiny else ""), "layers": s["layers"],
        "tiny": args.tiny,
        "mode": args.mode,
        "tokens_per_step": tokens_per_step,
        "warmup": args.warmup,
        "steps": args.steps,
        "step_times_s": [round(x, 4) for x in times],
        "tokens_per_s": round(tokens_per_step * len(times) / timed, 1) if timed > 0 else None,
        "losses": [round(x, 5) for x in losses],
        "losses_include_warmup": True,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_reserved(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trainable_params": trainable_params,
        "model_params": model_params,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "peft": peft_version,
        "warmup_step_times_s": [round(x, 4) for x in warm_times],
        "final_optimizer_drain_s": round(drain_s, 4),
        "expected_first_loss": round(expected_first_loss(s), 4),
        "sequences_per_step": mbs * M * K,
        "seq_len": seq,
        "microbatches": M,
        "accum_calls": K,
        "microbatch_size": mbs,
        "lr": s["lr"],
        "lr_schedule": "constant",
        "grad_clip": clip,
        "dtype": "bf16 weights, fp32 optimizer masters",
        "data": "one fixed random batch (seed %d), reused every step as in benchmark/train.py" % s["seed"],
        "pin_model": pin,
        "pin_model_reason": pin_reason,
        "build_s": round(build_s, 1),
        "wrap_s": round(wrap_s, 1),
        "device": torch.cuda.get_device_name(0),
        "config_file": os.path.relpath(toml_path, HERE) if toml_path else None,
        "stand_in_modules": shimmed,
        **build_info,
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip atexit joins of RoundPipe's threads


if __name__ == "__main__":
    main()
