#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/prepare_data.py without transformers: the chat masks of both paths (generation markers
and rendering) with a stand-in tokenizer returning transformers 4.x and 5.x shapes, a template
that rewrites earlier turns, the files the byte tokenizer writes, the errors, and that rp-launch
trains on both output formats.   prepare_data_test.py SOURCE_DIR BIN_DIR"""
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from array import array

src, bins = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(src, "tools", "prepare_data.py"))
prep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prep)
tool = [sys.executable, os.path.join(src, "tools", "prepare_data.py"), "--tokenizer", "bytes"]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


class StandIn:
    """A ChatML tokenizer: one token per character, <|im_start|> and <|im_end|> one token each.
    shape: "4" (tokenize=True gives a list), "5" (a dict), "5b" (a dict of a batch of one).
    markers: the template has {% generation %} markers (around content and <|im_end|>).
    rewrites: earlier assistant turns lose their <think>...</think> once a user turn follows."""
    SPECIAL = ["<|im_start|>", "<|im_end|>"]

    def __init__(self, shape, markers, rewrites=False):
        self.shape, self.rewrites = shape, rewrites
        self.chat_template = "{% generation %}...{% endgeneration %}" if markers else "{{ messages }}"
        self.eos_token_id = 257

    def __len__(self):
        return 300

    def _split(self, text):
        out, i = [], 0
        while i < len(text):
            for k, s in enumerate(self.SPECIAL):
                if text.startswith(s, i):
                    out.append((256 + k, i, i + len(s)))
                    i += len(s)
                    break
            else:
                out.append((ord(text[i]) % 256, i, i + 1))
                i += 1
        return out

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        toks = self._split(text)
        out = {"input_ids": ([299] if add_special_tokens else []) + [t[0] for t in toks]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(a, b) for _, a, b in toks]
        return out

    def render(self, messages, add_generation_prompt):
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        text, spans = "", []
        for i, m in enumerate(messages):
            content = m["content"]
            if self.rewrites and m["role"] == "assistant" and users and i < users[-1]:
                content = re.sub(r"<think>.*?</think>\s*", "", content, flags=re.S)
            text += "<|im_start|>" + m["role"] + "\n"
            start = len(text)
            text += content + "<|im_end|>"
            if m["role"] == "assistant":
                spans.append((start, len(text)))
            text += "\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text, spans

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, return_dict=False,
                            return_assistant_tokens_mask=False):
        text, spans = self.render(messages, add_generation_prompt)
        if not tokenize:
            return text
        toks = self._split(text)
        ids = [t[0] for t in toks]
        if self.shape == "4" and not return_dict:
            return ids
        out = {"input_ids": ids}
        if return_assistant_tokens_mask:
            out["assistant_masks"] = [1 if any(s <= a < e for s, e in spans) else 0 for _, a, _ in toks]
        if self.shape == "5b":
            out = {k: [v] for k, v in out.items()}
        return out


def trained_text(tok, ids, mask):
    """The trained tokens as text, turns joined by |."""
    chars, prev = [], 0
    for t, m in zip(ids, mask):
        if m:
            chars.append(StandIn.SPECIAL[t - 256] if t >= 256 else chr(t))
        elif prev:
            chars.append("|")
        prev = m
    return "".join(chars).strip("|")


chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>add</think>\n4"}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>again</think>\n6"}]

# _field: every shape transformers returns.
class Tensorish(list):
    def tolist(self):
        return list(self)


check(prep._field([1, 2], "input_ids") == [1, 2], "a plain list")
check(prep._field({"input_ids": [1, 2]}, "input_ids") == [1, 2], "a dict")
check(prep._field({"input_ids": [[1, 2]]}, "input_ids") == [1, 2], "a batch of one")
check(prep._field({"input_ids": Tensorish([[1, 2]])}, "input_ids") == [1, 2], "a tensor")
try:
    prep._field({"input_ids": [[1], [2]]}, "input_ids")
    check(False, "a batch of two is refused")
except prep.PrepareError:
    pass

# Both paths give the same tokens and masks on a template with markers, in every return shape;
# the trained text is each assistant turn with its end of turn.
for shape in ("4", "5", "5b"):
    tok = prep.HfTokenizer(StandIn(shape, markers=True), "stand-in")
    ids_m, mask_m = tok.chat(chat, "auto")
    ids_r, mask_r = tok.chat(chat, "render")
    full = prep._field(StandIn(shape, True).apply_chat_template(chat, return_dict=True), "input_ids")
    check(ids_m == full and ids_r == full, f"shape {shape}: the tokens are the template's")
    check(mask_m == mask_r, f"shape {shape}: markers and rendering agree")
    check(trained_text(tok, ids_m, mask_m) == "<think>add</think>\n4<|im_end|>|<think>again</think>\n6<|im_end|>",
          f"shape {shape}: assistant turns trained: {trained_text(tok, ids_m, mask_m)!r}")

# A template that rewrites earlier turns and has no markers: rendered once, the first answer
# without its reasoning, the last with it.
tok = prep.HfTokenizer(StandIn("5", markers=False, rewrites=True), "stand-in")
ids, mask = tok.chat(chat, "auto")
check(trained_text(tok, ids, mask) == "4<|im_end|>|<think>again</think>\n6<|im_end|>",
      "rewritten turns: " + trained_text(tok, ids, mask))
check("add" not in "".join(chr(t) for t in ids if t < 256), "the earlier reasoning is not in the tokens")
for method, words in (("markers", "no {% generation %} markers"),):
    try:
        tok.chat(chat, method)
        check(False, "markers without markers is refused")
    except prep.PrepareError as e:
        check(words in str(e), str(e))
try:
    tok.chat([{"role": "user", "content": "hi"}], "auto")
    check(False, "a chat without an assistant turn is refused")
except prep.PrepareError as e:
    check("without an assistant turn" in str(e), str(e))

segments_before = set(glob.glob("/dev/shm/rp-*"))
with tempfile.TemporaryDirectory() as d:
    data = os.path.join(d, "mixed.jsonl")
    records = []
    for i in range(40):
        records.append({"messages": [{"role": "user", "content": f"question {i}?"},
                                     {"role": "assistant", "content": f"answer {i}."}]})
        records.append({"prompt": f"Say {i}: ", "completion": f"{i} said."})
        records.append({"text": f"Plain text number {i}."})
    with open(data, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    out = os.path.join(d, "mixed.bin")
    r = run(tool + [data, out])
    check(r.returncode == 0, "tokens output: " + r.stderr)
    side = json.load(open(out + ".json"))
    ids = array("H")
    ids.frombytes(open(out, "rb").read())
    offsets = array("Q")
    offsets.frombytes(open(out + ".docs", "rb").read())
    mask = open(out + ".mask", "rb").read()
    check(side["documents"] == 120 and side["tokens"] == len(ids) == len(mask) == offsets[-1] and
          len(offsets) == 121 and side["dtype"] == "uint16" and side["vocab_size"] == 256 and side["loss_mask"],
          f"sidecar, index and mask agree: {side}")
    first = bytes(list(ids[offsets[0]:offsets[1]]))
    check(first == b"user: question 0?\nassistant: answer 0.\n", first)
    user = len(b"user: question 0?\n")
    check(list(mask[:user]) == [0] * user and all(mask[user:offsets[1]]), "chat: the assistant's turn only")
    pc = bytes(list(ids[offsets[1]:offsets[2]]))
    check(pc == b"Say 0: 0 said." and list(mask[offsets[1]:offsets[2]]) == [0] * 7 + [1] * 7,
          "completion: the prompt is not trained on")
    check(all(mask[offsets[2]:offsets[3]]), "text: all trained on")
    r = run(tool + [data, out])
    check(r.returncode != 0 and "not overwriting" in r.stderr, "refuses to overwrite: " + r.stderr)
    jout = os.path.join(d, "mixed-out.jsonl")
    r = run(tool + [data, jout, "--format", "jsonl", "--train-on", "all"])
    check(r.returncode == 0, "jsonl output: " + r.stderr)
    check(json.loads(open(jout).readline())["loss_mask"] == [1] * len(first), "--train-on all")

    sharegpt = os.path.join(d, "sharegpt.jsonl")
    with open(sharegpt, "w") as f:
        f.write(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n")
    r = run(tool + [sharegpt, os.path.join(d, "sg.jsonl"), "--format", "jsonl", "--messages-key", "conversations",
                    "--role-key", "from", "--content-key", "value", "--role-map", "human=user,gpt=assistant"])
    check(r.returncode == 0, "renamed keys: " + r.stderr)
    check(bytes(json.loads(open(os.path.join(d, "sg.jsonl")).readline())["input_ids"]) ==
          b"user: hi\nassistant: yo\n", "roles renamed")

    for bad_line, words in (('{not json', "mixed-bad.jsonl:2: not JSON"),
                            ('{"messages": [{"role": "user"}]}', "mixed-bad.jsonl:2: turn 0 must be"),
                            ('{"prompt": "p"}', "must both be strings"),
                            ('{"question": "q"}', "none of")):
        bad = os.path.join(d, "mixed-bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"text": "ok"}\n' + bad_line + "\n")
        r = run(tool + [bad, os.path.join(d, "bad.bin")])
        check(r.returncode != 0 and words in r.stderr, f"{bad_line}: {r.stderr}")
        check(not any(os.path.exists(os.path.join(d, "bad.bin" + s)) for s in ("", ".docs", ".mask", ".json", ".partial")),
              "no output after an error")

    env = dict(os.environ, XDG_RUNTIME_DIR=d)
    job = os.path.join(src, "tests", "testdata", "parity.toml")
    for fmt, path in (("tokens", out), ("jsonl", jout)):
        run_dir = os.path.join(d, "run-" + fmt)
        r = run([os.path.join(bins, "rp-launch"), "--gpus", "1", job, "--set", "job.output_dir=" + run_dir,
                 "--set", "data.format=" + fmt, "--set", "data.path=" + path, "--set", "train.steps=2"],
                env=env, timeout=120)
        check(r.returncode == 0, f"rp-launch trains on the {fmt} output: {r.stderr[-2000:]}")
        check("120 records" in r.stdout + r.stderr and "documents packing" in r.stdout + r.stderr,
              f"{fmt}: read as 120 records packed as documents")
        check(len(open(os.path.join(run_dir, "metrics.jsonl")).readlines()) == 2, f"{fmt}: two steps")
check(set(glob.glob("/dev/shm/rp-*")) == segments_before, "no shared-memory segment left behind")
print("prepare_data_test:", "FAILED" if failures else "passed")
sys.exit(1 if failures else 0)
