#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prepares text, prompt/completion and chat data for RoundPipe: tokens, loss masks, documents.

    tools/prepare_data.py INPUT OUTPUT --tokenizer NAME_OR_DIR [--format tokens|jsonl]

INPUT: *.jsonl, one JSON object per line in one of these shapes (the keys can be renamed, see
--help; a Hugging Face dataset saved with `to_json` is such a file):
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}   chat
  {"prompt": "...", "completion": "..."}                                               completion
  {"text": "..."}                                                                      text
or *.txt, plain text whose documents are separated by blank lines.

What is trained on (--train-on auto): a chat's assistant turns, a completion (not its prompt),
all of a text. --train-on all trains on every token.

Chats go through the model's own chat template. The assistant's tokens come from the
template's generation markers ({% generation %}) where it has them (transformers'
return_assistant_tokens_mask), else by rendering: the conversation is rendered once, and each
assistant turn runs from the end of the conversation before it with the generation prompt
(which must be a prefix of the whole rendering) to the template's end-of-turn text. Templates
that rewrite earlier turns (dropping the reasoning of earlier assistant turns, as Qwen3's does)
work this way: the rendering that is trained on is the whole conversation's. --mask-method
chooses the path (auto: markers when present).

OUTPUT with --format tokens (data.format = "tokens", the default): OUTPUT holds the token ids
(uint16 when the vocabulary fits, else uint32), OUTPUT.docs the document index (documents + 1
little-endian uint64 offsets), OUTPUT.mask one byte per token (1 = trained on), and OUTPUT.json
{"dtype", "vocab_size", "documents", "loss_mask", "tokens", "trained_tokens", "tokenizer",
"source"}. With --format jsonl: one {"input_ids": [...], "loss_mask": [...]} per record.

--tokenizer takes a Hugging Face tokenizer name or directory (needs `transformers`; any version
from 4.4x), or `bytes`: one token per byte, vocabulary 256, no end-of-sequence token, a chat as
"role: content" lines, which needs nothing installed.
Nothing is overwritten (an existing output is an error); a malformed record stops the tool with
its file and line, and nothing is written.
"""
import argparse
import json
import os
import re
import sys
from array import array


class PrepareError(Exception):
    """A record or an option the tool cannot use; the message names it."""


def _field(result, key):
    """A token list from apply_chat_template or a tokenizer call, whatever shape this version of
    transformers returns: a plain list (4.x, tokenize=True), a dict or BatchEncoding (return_dict,
    and 5.x always), a batch of one ([[...]]), or a tensor."""
    value = result
    if not isinstance(result, (list, tuple)):
        try:
            value = result[key]
        except (KeyError, TypeError, IndexError):
            raise PrepareError(f"the tokenizer returned no {key!r} (got {type(result).__name__})")
    if hasattr(value, "tolist"):
        value = value.tolist()
    value = list(value)
    if value and isinstance(value[0], (list, tuple)):
        if len(value) != 1:
            raise PrepareError(f"the tokenizer returned a batch of {len(value)} for one conversation")
        value = list(value[0])
    return [int(x) for x in value]


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    eos_token_id = None

    def encode(self, text, special=False):
        return list(text.encode("utf-8"))

    def chat(self, messages, method):
        ids, mask = [], []
        for m in messages:
            turn = self.encode(f"{m['role']}: {m['content']}\n")
            ids += turn
            mask += [1 if m["role"] == "assistant" else 0] * len(turn)
        return ids, mask


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class HfTokenizer:
    """A transformers tokenizer (or anything with its call and apply_chat_template)."""

    def __init__(self, tok, name):
        self.tok = tok
        self.name = name
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id
        self._end_of_turn = None

    @classmethod
    def load(cls, name):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise PrepareError(f"--tokenizer {name} needs the Python package transformers "
                               "(or use --tokenizer bytes)")
        return cls(AutoTokenizer.from_pretrained(name), name)

    def encode(self, text, special=False):
        return _field(self.tok(text, add_special_tokens=special), "input_ids")

    def has_markers(self):
        template = getattr(self.tok, "chat_template", None)
        return isinstance(template, str) and _GENERATION.search(template) is not None

    def chat(self, messages, method):
        if not any(m["role"] == "assistant" for m in messages):
            raise PrepareError("a chat without an assistant turn has nothing to train on")
        if method == "auto":
            method = "markers" if self.has_markers() else "render"
        if method == "markers":
            if not self.has_markers():
                raise PrepareError("--mask-method markers: this chat template has no {% generation %} markers")
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            ids, mask = _field(out, "input_ids"), _field(out, "assistant_masks")
            if len(ids) != len(mask):
                raise PrepareError(f"the template's assistant mask has {len(mask)} entries for {len(ids)} tokens")
            return ids, [1 if x else 0 for x in mask]
        return self._chat_by_rendering(messages)

    def _render(self, messages, generation_prompt=False):
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise PrepareError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def end_of_turn(self):
        """The text the template puts after an assistant's content, up to its last non-space
        character ("<|im_end|>" for ChatML): an assistant turn is trained on through it."""
        if self._end_of_turn is None:
            marker = "\u2063RP-END-PROBE\u2063"
            text = self._render([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}])
            if marker not in text:
                raise PrepareError("the chat template drops an assistant's content; cannot find its turns")
            self._end_of_turn = text[text.index(marker) + len(marker):].rstrip()
        return self._end_of_turn

    def _chat_by_rendering(self, messages):
        text = self._render(messages)
        end = self.end_of_turn()
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True) if i > 0 else ""
            if not text.startswith(before):
                raise PrepareError(f"assistant turn {i}: the conversation before it, with the generation "
                                   "prompt, is not the start of the whole conversation's rendering")
            start = len(before)
            stop = text.find(end, start) if end else -1
            if end and stop < 0:
                raise PrepareError(f"assistant turn {i}: no end of turn {end!r} after it")
            spans.append((start, stop + len(end) if end else len(text)))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = _field(enc, "input_ids"), enc["offset_mapping"]
        if hasattr(offsets, "tolist"):
            offsets = offsets.tolist()
        if offsets and isinstance(offsets[0][0], (list, tuple)):
            offsets = offsets[0]
        # A token is trained on when it covers a character of a turn (as transformers' markers
        # mask counts tokens, by the characters they cover).
        mask = [1 if any(a < e and b > s for s, e in spans) else 0 for a, b in offsets]
        return ids, mask


def read_records(path, keys):
    """Yields (where, kind, record) per document, kind "text", "completion" or "chat"."""
    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            doc, first = [], 1
            for n, line in enumerate(f, 1):
                if line.strip():
                    if not doc:
                        first = n
                    doc.append(line)
                elif doc:
                    yield f"{path}:{first}", "text", "".join(doc)
                    doc = []
            if doc:
                yield f"{path}:{first}", "text", "".join(doc)
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{where}: not JSON ({e})")
            if not isinstance(rec, dict):
                raise PrepareError(f"{where}: not a JSON object")
            if keys.messages in rec:
                msgs = rec[keys.messages]
                if not isinstance(msgs, list) or not msgs:
                    raise PrepareError(f"{where}: \"{keys.messages}\" must be a non-empty list of turns")
                turns = []
                for t, m in enumerate(msgs):
                    if not isinstance(m, dict) or not isinstance(m.get(keys.role), str) or \
                            not isinstance(m.get(keys.content), str):
                        raise PrepareError(f"{where}: turn {t} must be {{\"{keys.role}\": str, "
                                           f"\"{keys.content}\": str}}")
                    role = keys.role_map.get(m[keys.role], m[keys.role])
                    turns.append({**{k: v for k, v in m.items() if k not in (keys.role, keys.content)},
                                  "role": role, "content": m[keys.content]})
                yield where, "chat", turns
            elif keys.prompt in rec or keys.completion in rec:
                p, c = rec.get(keys.prompt), rec.get(keys.completion)
                if not isinstance(p, str) or not isinstance(c, str):
                    raise PrepareError(f"{where}: \"{keys.prompt}\" and \"{keys.completion}\" must both be strings")
                yield where, "completion", (p, c)
            elif isinstance(rec.get(keys.text), str):
                yield where, "text", rec[keys.text]
            else:
                raise PrepareError(f"{where}: none of \"{keys.messages}\", \"{keys.prompt}\"/\"{keys.completion}\" "
                                   f"or a string \"{keys.text}\" (rename keys with --messages-key, --prompt-key, "
                                   "--completion-key, --text-key)")


def tokenize_record(tok, kind, rec, train_on, method, eos):
    """(ids, mask) of one record; mask[i] = 1 when token i is trained on."""
    if kind == "text":
        ids = tok.encode(rec, special=True) + eos
        return ids, [1] * len(ids)
    if kind == "completion":
        prompt, completion = tok.encode(rec[0], special=True), tok.encode(rec[1]) + eos
        return prompt + completion, [1 if train_on == "all" else 0] * len(prompt) + [1] * len(completion)
    ids, mask = tok.chat(rec, method)
    return ids, [1] * len(ids) if train_on == "all" else mask


def outputs(output, fmt):
    return [output] if fmt == "jsonl" else [output, output + ".docs", output + ".mask", output + ".json"]


def prepare(tok, a):
    for p in outputs(a.output, a.format):
        if os.path.exists(p):
            raise PrepareError(f"{p} exists; not overwriting it")
    eos = [] if tok.eos_token_id is None or a.no_eos else [tok.eos_token_id]
    keys = argparse.Namespace(messages=a.messages_key, prompt=a.prompt_key, completion=a.completion_key,
                              text=a.text_key, role=a.role_key, content=a.content_key,
                              role_map=dict(kv.split("=", 1) for kv in a.role_map.split(",") if kv))
    typecode = "H" if tok.vocab_size <= 1 << 16 else "I"
    docs = tokens = trained = 0
    parts = [p + ".partial" for p in outputs(a.output, a.format)]
    try:
        if a.format == "jsonl":
            sinks = [open(parts[0], "w", encoding="utf-8")]
        else:
            sinks = [open(p, "wb") for p in parts[:3]]
            array("Q", [0]).tofile(sinks[1])
        for where, kind, rec in read_records(a.input, keys):
            try:
                ids, mask = tokenize_record(tok, kind, rec, a.train_on, a.mask_method, eos)
            except PrepareError as e:
                raise PrepareError(f"{where}: {e}")
            if not ids:
                raise PrepareError(f"{where}: no tokens")
            if not any(mask[1:]):
                raise PrepareError(f"{where}: nothing to train on (no masked-in token after the first)")
            docs += 1
            tokens += len(ids)
            trained += sum(mask)
            if a.format == "jsonl":
                sinks[0].write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            else:
                array(typecode, ids).tofile(sinks[0])
                array("Q", [tokens]).tofile(sinks[1])
                sinks[2].write(bytes(mask))
        for s in sinks:
            s.close()
        if docs == 0:
            raise PrepareError(f"{a.input}: no records")
        if a.format == "tokens":
            with open(parts[3], "w") as f:
                json.dump({"dtype": "uint16" if typecode == "H" else "uint32", "vocab_size": tok.vocab_size,
                           "documents": docs, "loss_mask": True, "tokens": tokens, "trained_tokens": trained,
                           "tokenizer": tok.name, "source": os.path.basename(a.input)}, f, indent=1)
                f.write("\n")
        # The sidecar last: a reader finds the data whole or not at all.
        for part, final in zip(parts, outputs(a.output, a.format)):
            os.replace(part, final)
    finally:
        for p in parts:
            if os.path.exists(p):
                os.remove(p)
    return docs, tokens, trained


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--tokenizer", required=True, help="Hugging Face name or directory, or 'bytes'")
    ap.add_argument("--format", choices=["tokens", "jsonl"], default="tokens")
    ap.add_argument("--train-on", choices=["auto", "all"], default="auto",
                    help="auto: assistant turns, completions, whole texts; all: every token")
    ap.add_argument("--mask-method", choices=["auto", "markers", "render"], default="auto",
                    help="how a chat's assistant tokens are found (auto: markers when the template has them)")
    ap.add_argument("--no-eos", action="store_true", help="no end-of-sequence token after texts and completions")
    ap.add_argument("--messages-key", default="messages")
    ap.add_argument("--role-key", default="role")
    ap.add_argument("--content-key", default="content")
    ap.add_argument("--role-map", default="", help="role renames, e.g. human=user,gpt=assistant")
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--completion-key", default="completion")
    ap.add_argument("--text-key", default="text")
    a = ap.parse_args(argv)
    try:
        if not os.path.isfile(a.input):
            raise PrepareError(f"{a.input}: no such file (the JSONL or text to prepare)")
        tok = ByteTokenizer() if a.tokenizer == "bytes" else HfTokenizer.load(a.tokenizer)
        docs, tokens, trained = prepare(tok, a)
    except (PrepareError, OSError) as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 1
    print(f"prepare_data: {docs} records, {tokens} tokens ({trained} trained on) -> {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
