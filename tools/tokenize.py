#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tokenizes text or chat data into the files RoundPipe trains on.

    tools/tokenize.py --tokenizer NAME_OR_DIR INPUT OUTPUT [--format tokens|jsonl]

INPUT is one of
  *.txt    plain text; documents are separated by blank lines
  *.jsonl  one JSON object per line: {"text": "..."} (--text-key), or a chat
           {"messages": [{"role": "user", "content": "..."}, ...]} (--messages-key)
OUTPUT, with --format tokens (data.format = "tokens"): a flat file of token ids (uint16 when the
vocabulary fits, else uint32) with the sidecar OUTPUT.json {"dtype", "vocab_size"}; documents
are joined with the tokenizer's end-of-sequence token. Chats need --format jsonl, because a
flat file cannot say which tokens are trained on.
With --format jsonl (data.format = "jsonl"): one {"input_ids": [...], "labels": [...]} per
record; in a chat, every token outside the assistant's turns is labelled -100 (not trained on).

--tokenizer takes a Hugging Face tokenizer name or directory (needs `transformers`), or `bytes`:
one token per byte, vocabulary 256, no end-of-sequence token, which needs nothing installed
(data.format = "bytes" reads raw text the same way without this script).
Nothing is overwritten: an existing OUTPUT is an error.
"""
import argparse
import json
import os
import sys
from array import array


class ByteTokenizer:
    vocab_size = 256
    eos_token_id = None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def chat(self, messages):
        # A plain transcript: "role: content\n" per turn.
        return [self.encode(f"{m['role']}: {m['content']}\n") for m in messages]


class HfTokenizer:
    def __init__(self, name):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            sys.exit("tokenize: --tokenizer %s needs the Python package transformers "
                     "(or use --tokenizer bytes)" % name)
        self.tok = AutoTokenizer.from_pretrained(name)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def chat(self, messages):
        # Token spans per turn: the template applied to growing prefixes. Templates that
        # rewrite earlier turns when later ones are added are detected and refused.
        spans, prev = [], []
        for i in range(len(messages)):
            ids = self.tok.apply_chat_template(messages[: i + 1], tokenize=True)
            if ids[: len(prev)] != prev:
                sys.exit("tokenize: this chat template changes earlier turns as the chat grows; "
                         "cannot tell which tokens belong to the assistant")
            spans.append(ids[len(prev):])
            prev = ids
        return spans


def read_records(path, text_key, messages_key):
    """Yields ("text", str) or ("chat", [messages]) per document; errors name file and line."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"tokenize: {path}:{n}: not JSON ({e})")
                if not isinstance(rec, dict):
                    sys.exit(f"tokenize: {path}:{n}: not a JSON object")
                if messages_key in rec:
                    msgs = rec[messages_key]
                    if not isinstance(msgs, list) or not all(
                            isinstance(m, dict) and isinstance(m.get("role"), str) and
                            isinstance(m.get("content"), str) for m in msgs):
                        sys.exit(f"tokenize: {path}:{n}: \"{messages_key}\" must be a list of "
                                 "{\"role\": str, \"content\": str}")
                    yield "chat", msgs
                elif isinstance(rec.get(text_key), str):
                    yield "text", rec[text_key]
                else:
                    sys.exit(f"tokenize: {path}:{n}: no string \"{text_key}\" and no \"{messages_key}\"")
    else:
        with open(path, encoding="utf-8") as f:
            doc = []
            for line in f:
                if line.strip():
                    doc.append(line)
                elif doc:
                    yield "text", "".join(doc)
                    doc = []
            if doc:
                yield "text", "".join(doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--tokenizer", required=True, help="Hugging Face name or directory, or 'bytes'")
    ap.add_argument("--format", choices=["tokens", "jsonl"], default="tokens")
    ap.add_argument("--text-key", default="text")
    ap.add_argument("--messages-key", default="messages")
    a = ap.parse_args()
    for p in (a.output, a.output + ".json") if a.format == "tokens" else (a.output,):
        if os.path.exists(p):
            sys.exit(f"tokenize: {p} exists; not overwriting it")
    tok = ByteTokenizer() if a.tokenizer == "bytes" else HfTokenizer(a.tokenizer)
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    tmp = a.output + ".partial"
    docs = tokens = trained = 0
    if a.format == "tokens":
        typecode = "H" if tok.vocab_size <= 1 << 16 else "I"
        with open(tmp, "wb") as out:
            for kind, rec in read_records(a.input, a.text_key, a.messages_key):
                if kind == "chat":
                    sys.exit("tokenize: chats need --format jsonl (labels mark the assistant's tokens)")
                ids = tok.encode(rec) + eos
                array(typecode, ids).tofile(out)
                docs += 1
                tokens += len(ids)
        with open(a.output + ".json", "w") as f:
            json.dump({"dtype": "uint16" if typecode == "H" else "uint32",
                       "vocab_size": tok.vocab_size}, f)
            f.write("\n")
        trained = tokens
    else:
        with open(tmp, "w", encoding="utf-8") as out:
            for kind, rec in read_records(a.input, a.text_key, a.messages_key):
                if kind == "text":
                    ids = tok.encode(rec) + eos
                    labels = list(ids)
                else:
                    ids, labels = [], []
                    for msg, span in zip(rec, tok.chat(rec)):
                        ids += span
                        labels += span if msg["role"] == "assistant" else [-100] * len(span)
                out.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
                docs += 1
                tokens += len(ids)
                trained += sum(1 for x in labels if x != -100)
    os.replace(tmp, a.output)
    print(f"tokenize: {docs} documents, {tokens} tokens ({trained} trained on) -> {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
