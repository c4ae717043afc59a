#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's "Fine-tune your model" commands, run as written on CPU workers (CI):
#   tests/tools/quickstart_cpu_test.sh SOURCE_DIR BIN_DIR
# What needs the network or transformers is replaced, and nothing else: the download is left out;
# Qwen/Qwen3-0.6B resolves, in a Hugging Face cache of the test's own, to a tiny Qwen3 exported by
# rp-launch (the chat fixtures' tokenizer beside it); prepare_data.py's output is the committed
# one of tests/testdata/chat (its documents repeated into a few windows); the closing transformers
# command runs on a GPU host (scripts/quickstart_check.sh). The commands' build-cuda/ is BIN_DIR's
# build. The jobs say job.device = "auto": without a GPU their workers are CPU workers.
# Exit 77 (skipped) where a file the commands write already exists: nothing of it is touched.
set -euo pipefail
src=$(cd "$1" && pwd); bin=$(cd "$2" && pwd)
cd "$src"
written=(data/my_chat.bin data/my_chat.bin.docs data/my_chat.bin.mask data/my_chat.bin.json
         runs/sft-qwen3-0.6b-lora runs/sft-qwen3-0.6b-full)
for f in "${written[@]}"; do
  if [ -e "$f" ]; then echo "quickstart_cpu_test: $f exists; skipped"; exit 77; fi
done
work=$(mktemp -d /tmp/rp-quickstart-cpu-XXXXXX)
trap 'rm -rf "$work" "${written[@]}"' EXIT

# The stand-in base: a Qwen3 of the fixtures' vocabulary, written by rp-launch's export.
cat > "$work/base.toml" <<EOF
[job]
output_dir = "$work/base-run"
device = "cpu"
[model]
vocab_size = 383
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 1
num_kv_heads = 1
head_dim = 16
qk_norm = true
tie_embeddings = false
[data]
format = "random"
seq_len = 32
[train]
steps = 1
microbatches = 2
accum_calls = 1
[optimizer]
lr = 0.0
min_lr = 0.0
[checkpoint]
export_hf = "hf"
EOF
"$bin/rp-launch" --gpus 1 "$work/base.toml" > "$work/base.log" 2>&1 || { tail -20 "$work/base.log"; exit 1; }
snapshot="$work/hub/models--Qwen--Qwen3-0.6B/snapshots/0123456789abcdef0123456789abcdef01234567"
mkdir -p "$snapshot" "$work/hub/models--Qwen--Qwen3-0.6B/refs"
cp "$work"/base-run/hf/* tests/testdata/chat/tokenizer/* "$snapshot/"
printf 0123456789abcdef0123456789abcdef01234567 > "$work/hub/models--Qwen--Qwen3-0.6B/refs/main"

# prepare_data.py's output: the committed chat token file, its documents repeated to three
# 4096-token windows (one of them the 2% eval split's).
python3 - "$src/tests/testdata/chat/chatml.bin" data/my_chat.bin 64 <<'PY'
import array, json, sys
src, dst, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
side = json.load(open(src + ".json"))
ids = open(src, "rb").read()
offsets = array.array("Q"); offsets.frombytes(open(src + ".docs", "rb").read())
mask = open(src + ".mask", "rb").read()
width = 2 if side["dtype"] == "uint16" else 4
out_offsets = array.array("Q", [0])
for _ in range(times):
    for d in range(len(offsets) - 1):
        out_offsets.append(out_offsets[-1] + offsets[d + 1] - offsets[d])
open(dst, "wb").write(ids * times)
open(dst + ".docs", "wb").write(out_offsets.tobytes())
open(dst + ".mask", "wb").write(mask * times)
side.update(documents=side["documents"] * times, tokens=side["tokens"] * times,
            trained_tokens=side["trained_tokens"] * times)
json.dump(side, open(dst + ".json", "w"))
assert len(ids) // width * times == side["tokens"]
PY

# The README's block, as written, but for the download, prepare_data.py (done above) and the
# closing transformers command.
awk '/^### Fine-tune your model/ {on = 1} on && /^```$/ {n++; if (n == 2) exit; next} on && n == 1' README.md \
  > "$work/block.sh"
grep -q '^python3 tools/prepare_data.py my_chat.jsonl data/my_chat.bin --tokenizer Qwen/Qwen3-0.6B$' "$work/block.sh" ||
  { echo "quickstart_cpu_test: the README's prepare_data.py command changed; update this test" >&2; exit 1; }
awk '/^hf download/ || /^python3 tools\/prepare_data.py/ {next} /^python3 -c/ {skip = 1} !skip {print}
     skip && /\)\)'"'"'$/ {skip = 0}' "$work/block.sh" | sed "s|^build-cuda/bin/|$bin/|" > "$work/quickstart.sh"
[ "$(grep -c "rp-launch" "$work/quickstart.sh")" -eq 3 ] ||
  { echo "quickstart_cpu_test: expected the README's three rp-launch commands:" >&2; cat "$work/quickstart.sh" >&2; exit 1; }
echo "quickstart_cpu_test: running"; cat "$work/quickstart.sh"
HF_HUB_CACHE="$work/hub" HF_HUB_OFFLINE=1 bash -euo pipefail -x "$work/quickstart.sh" 2>&1 |
  while IFS= read -r line; do printf '%s %s\n' "$(date +%T)" "$line"; done | grep -E '^[0-9:]+ (\+|rp-launch: [^w]|I .*step [0-9]+/)'
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "quickstart_cpu_test: a command failed" >&2; exit 1; }
for f in runs/sft-qwen3-0.6b-lora/adapter/adapter_model.safetensors runs/sft-qwen3-0.6b-lora/merged/config.json \
         runs/sft-qwen3-0.6b-lora/metrics.jsonl runs/sft-qwen3-0.6b-full/hf/model.safetensors \
         runs/sft-qwen3-0.6b-full/hf/tokenizer.json runs/sft-qwen3-0.6b-full/tb; do
  [ -e "$f" ] || { echo "quickstart_cpu_test: $f was not written" >&2; exit 1; }
done
echo "quickstart_cpu_test: every command ran"
