#!/usr/bin/env bash
# The fine-tuning walk-through, offline, from data to an exported model:
#   1. raw data from two Debian packages (scripts/demo_data.py): the
#      `fortunes` cookies as a pretraining corpus, `wordnet-base` glosses as
#      question/answer pairs, and a BPE tokenizer trained on the fortunes;
#   2. token files with python -m zinc.prepare (the answers alone count in
#      the fine-tune's loss; examples packed, attention kept within each);
#   3. configs/pretrain_fortunes.json: a small Llama from random weights,
#      exported with --save-pretrained to runs/demo/fortunes-llama;
#   4. configs/finetune_wordnet.json: that folder fine-tuned on the
#      questions, exported to runs/demo/wordnet-llama;
#   5. configs/finetune_wordnet_lora.json: the same fine-tune as LoRA
#      adapters on the frozen pretrained model, written as a PEFT adapter
#      folder to runs/demo/wordnet-lora;
#   6. where transformers is installed, the export answers a question
#      through transformers' generate(), and where peft is too, the adapter
#      on its base through PeftModel.
# Everything lands in runs/demo under the working directory
# (ZINC_DEMO_WORKDIR, default the repository). ZINC_DEMO_STEPS="P F" sets
# the two runs' steps; ZINC_DEMO_SETUP=0 skips scripts/setup.sh.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
[ "${ZINC_DEMO_SETUP:-1}" = 0 ] || bash "$repo/scripts/setup.sh"
cd "${ZINC_DEMO_WORKDIR:-$repo}"
read -r pretrain_steps finetune_steps <<<"${ZINC_DEMO_STEPS:-400 300}"
train="${ZINC_TRAIN:-$repo/build/tools/zinc-train}"
export PYTHONPATH="$repo/build/python${PYTHONPATH:+:$PYTHONPATH}"
out=runs/demo

echo "== 1. raw data and tokenizer"
python3 "$repo/scripts/demo_data.py" "$out"
echo "== 2. token files"
python3 -m zinc.prepare --tokenizer "$out/tokenizer" --seq-len 128 --chunk --out "$out/fortunes" "$out/fortunes.jsonl"
python3 -m zinc.prepare --tokenizer "$out/tokenizer" --seq-len 128 --use-chat-template --out "$out/wordnet" \
  "$out/wordnet.jsonl"
echo "== 3. pretrain ($pretrain_steps steps)"
"$train" "$repo/configs/pretrain_fortunes.json" --set "run.steps=$pretrain_steps" \
  --save-pretrained "$out/fortunes-llama" --save-dtype fp32  # the fine-tune starts from these exact weights
# A model trained from random weights has no tokenizer of its own: the
# export gets the one its data was made with (a from_pretrained export
# copies the source folder's).
cp "$out/tokenizer/tokenizer.json" "$out/tokenizer/tokenizer_config.json" "$out/fortunes-llama/"
echo "== 4. fine-tune ($finetune_steps steps)"
"$train" "$repo/configs/finetune_wordnet.json" --set "run.steps=$finetune_steps" \
  --save-pretrained "$out/wordnet-llama"
echo "== 5. fine-tune LoRA adapters ($finetune_steps steps)"
"$train" "$repo/configs/finetune_wordnet_lora.json" --set "run.steps=$finetune_steps" \
  --save-adapter "$out/wordnet-lora"
echo "== 6. generate"
if python3 -c "import transformers, torch" 2>/dev/null; then
  python3 "$repo/scripts/demo_generate.py" "$out/wordnet-llama" 'What does the noun "lantern" mean?'
else
  echo "transformers and torch are not installed: skipped (python3 scripts/demo_generate.py $out/wordnet-llama QUESTION where they are)"
fi
if python3 -c "import transformers, torch, peft" 2>/dev/null; then
  python3 "$repo/scripts/demo_generate.py" "$out/fortunes-llama" 'What does the noun "lantern" mean?' \
    --adapter "$out/wordnet-lora"
else
  echo "peft is not installed: skipped (python3 scripts/demo_generate.py $out/fortunes-llama QUESTION --adapter $out/wordnet-lora where it is)"
fi
