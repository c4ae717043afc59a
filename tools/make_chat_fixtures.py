#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Chat fixtures made by transformers and checked against tools/prepare_data.py.

    tools/make_chat_fixtures.py OUT_DIR

Needs transformers (4.4x or 5.x) and tokenizers. Writes into OUT_DIR:
  tokenizer/           a small byte-level BPE tokenizer trained here with `tokenizers`, saved by
                       transformers, with the ChatML template below (generation markers)
  chats.jsonl          a few conversations, some of several turns, some with reasoning
  expected.json        for each template: every conversation's token ids and assistant mask as
                       transformers computes them (apply_chat_template with
                       return_assistant_tokens_mask=True; for the template without markers, the
                       same template with markers added, which renders the same text)
  chatml.bin{,.docs,.mask,.json}  tools/prepare_data.py's output for the ChatML template, which
                       the C++ reader's test reads
Then checks that tools/prepare_data.py gives exactly the expected ids and masks through both of
its paths (markers and rendering) for the ChatML template, and through rendering for the template
that rewrites earlier turns; exits 1 naming the first difference otherwise.
"""
import importlib.util
import json
import os
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
import transformers  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(here, "prepare_data.py"))
prep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prep)

# ChatML with generation markers around what an assistant turn trains on: its content and the
# end-of-turn token.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that rewrites earlier turns: an assistant turn before the last user turn loses its
# reasoning (<think>...</think>), as reasoning models' templates do. {GEN}/{END} are the markers'
# places; without them it has none.
REWRITING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if loop.index0 < ns.last_user and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
    "{GEN}{{ c }}<|im_end|>{END}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWRITING_PLAIN = REWRITING.replace("{GEN}", "").replace("{END}", "")
REWRITING_MARKED = REWRITING.replace("{GEN}", "{% generation %}").replace("{END}", "{% endgeneration %}")

chats = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Two plus two is four."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "<think>Pick a common one.</think>\nBlue is a colour."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "<think>Not blue again.</think>\nGreen is another."}],
    [{"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "One, two, three."},
     {"role": "user", "content": "And back?"},
     {"role": "assistant", "content": "Three, two, one."}],
    [{"role": "user", "content": "Say nothing but ok."},
     {"role": "assistant", "content": "<think>Short.</think>\nok"}],
]
corpus = [m["content"] for c in chats for m in c] * 20 + ["The quick brown fox jumps over the lazy dog."] * 20

bpe = Tokenizer(models.BPE(unk_token=None))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
tok.chat_template = CHATML
tok.save_pretrained(os.path.join(out, "tokenizer"))
tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(out, "tokenizer"))

with open(os.path.join(out, "chats.jsonl"), "w") as f:
    for c in chats:
        f.write(json.dumps({"messages": c}) + "\n")


def oracle(template):
    rows = []
    for c in chats:
        r = tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                    chat_template=template)
        ids, mask = r["input_ids"], r["assistant_masks"]
        if ids and isinstance(ids[0], list):
            ids, mask = ids[0], mask[0]
        rows.append({"input_ids": list(ids), "assistant_masks": [int(x) for x in mask]})
    return rows


expected = {"transformers": transformers.__version__, "chatml": oracle(CHATML), "rewriting": oracle(REWRITING_MARKED)}
# The two templates differ where they should: the rewriting one drops the earlier reasoning.
assert expected["chatml"][1]["input_ids"] != expected["rewriting"][1]["input_ids"]
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(expected, f)
    f.write("\n")

failures = []
for name, template, methods in (("chatml", CHATML, ("markers", "render")), ("rewriting", REWRITING_PLAIN, ("render",))):
    tok.chat_template = template
    wrapped = prep.HfTokenizer(tok, "tokenizer")
    for method in methods + ("auto",):
        for i, c in enumerate(chats):
            ids, mask = wrapped.chat(c, method)
            want = expected[name][i]
            if ids != want["input_ids"] or mask != want["assistant_masks"]:
                failures.append(f"{name} / {method}: conversation {i}: ids equal {ids == want['input_ids']}, "
                                f"mask {mask} against {want['assistant_masks']}")
    print(f"{name}: prepare_data.py reproduces transformers through {', '.join(methods)} and auto")
tok.chat_template = CHATML
tok.save_pretrained(os.path.join(out, "tokenizer"))
os.chdir(out)  # the sidecar names the tokenizer and the source as given: relative
rc = prep.main(["chats.jsonl", "chatml.bin", "--tokenizer", "tokenizer"])
if rc != 0:
    failures.append("prepare_data.py on chats.jsonl failed")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
