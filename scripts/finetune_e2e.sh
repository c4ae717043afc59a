#!/usr/bin/env bash
# The fine-tuning path end to end on one GPU, checked by transformers and PEFT:
#   scripts/finetune_e2e.sh BUILD_DIR OUT_DIR [TOKENIZER_DIR]
# A tiny Qwen3 saved by transformers in bf16 with TOKENIZER_DIR's tokenizer (default
# tests/testdata/chat/tokenizer, the chat fixtures' ChatML tokenizer), a chat JSONL prepared by
# tools/prepare_data.py, a full fine-tune and a LoRA run (bf16, document packing, 3 epochs, eval
# on held-out chats after the last step), then tools/finetune_check.py: the exports load in
# transformers and give the run's eval loss, beat the base, generate, carry the base's
# tokenizer, generation config and special tokens, and PEFT's adapter gives the merged export's
# logits (fp32; the merged LoRA model is exported in float32 for it); rp-export of the runs' last
# checkpoints gives their exports byte for byte. Needs python3 with torch, transformers and peft, and a CUDA build. Exits 1 on a failed
# check; OUT_DIR/check.json holds the figures.
set -euo pipefail
build=$(realpath "$1"); out=$(realpath -m "$2"); tokenizer=${3:-tests/testdata/chat/tokenizer}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
python3 "$here/tools/finetune_check.py" base "$tokenizer" "$out"
for split in train eval; do
  python3 "$here/tools/prepare_data.py" "$out/$split.jsonl" "$out/$split.bin" --tokenizer "$out/base"
done
# The eval set is every held-out window once: as many eval microbatches of one window as the
# held-out chats pack into.
cat > "$out/dry.toml" <<EOF
[job]
output_dir = "dry"
[model]
path = "base"
[data]
format = "tokens"
path = "eval.bin"
seq_len = 512
EOF
windows=$("$build/bin/rp-launch" --gpus 1 "$out/dry.toml" --dry-run | sed -n 's/^data.path: .* \([0-9]*\) windows of .*/\1/p')
[ -n "$windows" ] || { echo "finetune_e2e: the dry run printed no window count" >&2; exit 1; }
echo "finetune_e2e: the held-out chats pack into $windows windows"
job() {  # name, learning rate, extra TOML
  cat > "$out/$1.toml" <<EOF
[job]
name = "e2e-$1"
output_dir = "$1"
device = "cuda"
[model]
path = "base"
[data]
format = "tokens"
path = "train.bin"
eval_path = "eval.bin"
seq_len = 512
[train]
epochs = 3
microbatches = 2
accum_calls = 1
microbatch_size = 2
dtype = "bf16"
eval_every = 100000
eval_microbatches = $windows
[optimizer]
lr = $2
min_lr = 1e-4
warmup_ratio = 0.1
weight_decay = 0.0
beta2 = 0.999
[schedule]
forward_stages = 2
backward_stages = 2
$3
EOF
  NCCL_NVLS_ENABLE=0 "$build/bin/rp-launch" --gpus 1 "$out/$1.toml"
}
job full 2e-3 $'[checkpoint]\nevery = 1000\nexport_hf = "hf"'
job lora 5e-3 $'[lora]\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]\nexport = "adapter"\n[checkpoint]\nevery = 1000\nexport_hf = "merged"\nexport_dtype = "float32"'
# rp-export turns the last checkpoint into the same files the runs exported.
"$build/bin/rp-export" "$out/full" --out "$out/full-rp-export"
"$build/bin/rp-export" "$out/lora" --merged --out "$out/lora-merged-rp-export"
cmp "$out/full/hf/model.safetensors" "$out/full-rp-export/model.safetensors"
cmp "$out/lora/merged/model.safetensors" "$out/lora-merged-rp-export/model.safetensors"
echo "finetune_e2e: rp-export gives the runs' own exports byte for byte"
python3 "$here/tools/finetune_check.py" check "$out"
