#!/usr/bin/env bash
# Runs the README's "Fine-tune your model" commands as written (all but the download), on a GPU
# host with python3, torch and transformers, from the repository root with a CUDA build in
# build-cuda/:
#   scripts/quickstart_check.sh
# The model id resolves to a stand-in: a tiny Qwen3 saved by transformers with the chat fixtures'
# tokenizer (tools/finetune_check.py), placed as Qwen/Qwen3-0.6B in a Hugging Face cache of its
# own (HF_HUB_CACHE, offline). my_chat.jsonl is a small generated chat set. Refuses to start if
# any file the commands write already exists, and removes what they wrote afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
written=(my_chat.jsonl data/my_chat.bin data/my_chat.bin.docs data/my_chat.bin.mask data/my_chat.bin.json
         runs/sft-qwen3-0.6b-lora runs/sft-qwen3-0.6b-full)
for f in "${written[@]}"; do
  [ ! -e "$f" ] || { echo "quickstart_check: $f exists; not touching it" >&2; exit 1; }
done
work=$(mktemp -d /tmp/rp-quickstart-XXXXXX)
trap 'rm -rf "$work" "${written[@]}"' EXIT
python3 tools/finetune_check.py base tests/testdata/chat/tokenizer "$work"
snapshot="$work/hub/models--Qwen--Qwen3-0.6B/snapshots/0123456789abcdef0123456789abcdef01234567"
mkdir -p "$snapshot" "$work/hub/models--Qwen--Qwen3-0.6B/refs"
cp "$work"/base/* "$snapshot/"
printf 0123456789abcdef0123456789abcdef01234567 > "$work/hub/models--Qwen--Qwen3-0.6B/refs/main"
cp "$work/train.jsonl" my_chat.jsonl
export HF_HUB_CACHE="$work/hub" HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
# The block under "### Fine-tune your model", without the download.
awk '/^### Fine-tune your model/ {on = 1} on && /^```$/ {n++; if (n == 2) exit; next} on && n == 1' README.md |
  grep -v '^hf download' > "$work/quickstart.sh"
echo "quickstart_check: running"; cat "$work/quickstart.sh"
bash -euo pipefail "$work/quickstart.sh"
for f in runs/sft-qwen3-0.6b-lora/adapter/adapter_model.safetensors runs/sft-qwen3-0.6b-lora/merged/config.json \
         runs/sft-qwen3-0.6b-full/hf/tokenizer.json runs/sft-qwen3-0.6b-full/hf/generation_config.json; do
  [ -f "$f" ] || { echo "quickstart_check: $f was not written" >&2; exit 1; }
done
echo "quickstart_check: every command ran"
