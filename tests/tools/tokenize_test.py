#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/tokenize.py with its dependency-free byte tokenizer: the files it writes, the errors it
gives, and that rp-launch trains on both output formats.   tokenize_test.py SOURCE_DIR BIN_DIR"""
import glob
import json
import os
import subprocess
import sys
import tempfile
from array import array

src, bins = sys.argv[1], sys.argv[2]
tool = [sys.executable, os.path.join(src, "tools", "tokenize.py"), "--tokenizer", "bytes"]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


segments_before = set(glob.glob("/dev/shm/rp-*"))
with tempfile.TemporaryDirectory() as d:
    text = os.path.join(d, "corpus.txt")
    docs = ["The first document.\nIt has two lines.\n", "Zweites Dokument: äöü.\n"]
    with open(text, "w", encoding="utf-8") as f:
        f.write(docs[0] + "\n\n" + docs[1] * 40)
    out = os.path.join(d, "corpus.bin")
    r = run(tool + [text, out])
    check(r.returncode == 0, "tokens output: " + r.stderr)
    with open(out, "rb") as f:
        ids = array("H")
        ids.frombytes(f.read())
    check(bytes(list(ids)) == (docs[0] + docs[1] * 40).encode("utf-8"), "token ids are the documents' bytes")
    check(json.load(open(out + ".json")) == {"dtype": "uint16", "vocab_size": 256}, "sidecar")
    r = run(tool + [text, out])
    check(r.returncode != 0 and "not overwriting" in r.stderr, "refuses to overwrite: " + r.stderr)

    chat = os.path.join(d, "chat.jsonl")
    with open(chat, "w") as f:
        for i in range(30):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"},
                                             {"role": "assistant", "content": f"answer {i}."}]}) + "\n")
    cout = os.path.join(d, "chat-tok.jsonl")
    r = run(tool + [chat, cout, "--format", "jsonl"])
    check(r.returncode == 0, "chat output: " + r.stderr)
    first = json.loads(open(cout).readline())
    user = len("user: question 0?\n".encode())
    check(first["labels"][:user] == [-100] * user, "the user's turn is not trained on")
    check(first["labels"][user:] == first["input_ids"][user:], "the assistant's turn is")
    r = run(tool + [chat, os.path.join(d, "chat.bin")])
    check(r.returncode != 0 and "need --format jsonl" in r.stderr, "chats refuse the flat format")
    bad = os.path.join(d, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "ok"}\n{not json\n')
    r = run(tool + [bad, os.path.join(d, "bad.out"), "--format", "jsonl"])
    check(r.returncode != 0 and "bad.jsonl:2" in r.stderr, "bad JSON names file and line: " + r.stderr)
    check(not os.path.exists(os.path.join(d, "bad.out")), "no output after an error")

    env = dict(os.environ, XDG_RUNTIME_DIR=d)
    job = os.path.join(src, "tests", "testdata", "parity.toml")
    for fmt, path in (("tokens", out), ("jsonl", cout)):
        r = run([os.path.join(bins, "rp-launch"), "--gpus", "1", job, "--set", "job.output_dir=" + os.path.join(d, "run-" + fmt),
                 "--set", "data.format=" + fmt, "--set", "data.path=" + path, "--set", "train.steps=2"], env=env, timeout=120)
        check(r.returncode == 0, f"rp-launch trains on the {fmt} output: {r.stderr[-2000:]}")
        check(len(open(os.path.join(d, "run-" + fmt, "metrics.jsonl")).readlines()) == 2, f"{fmt}: two steps")
check(set(glob.glob("/dev/shm/rp-*")) == segments_before, "no shared-memory segment left behind")
print("tokenize_test:", "FAILED" if failures else "passed")
sys.exit(1 if failures else 0)
