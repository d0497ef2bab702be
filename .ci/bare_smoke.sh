#!/usr/bin/env bash
# A bare install (no extras) in a fresh venv, then the CLI path a new user takes: fit a few steps of
# configs/quickstart.yaml, plan, export the checkpoint, eval it on the bundled samples. Run from a
# directory outside the clone, so nothing can come from the repository (../shared included).
# Usage: .ci/bare_smoke.sh [VENV_DIR]   (default: a temporary directory, removed afterwards)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-}"
WORK="$(mktemp -d)"
if [ -z "$VENV" ]; then VENV="$WORK/venv"; fi
trap 'rm -rf "$WORK"' EXIT
if [ ! -x "$VENV/bin/lightning-disttrain" ]; then
  python -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0   # the CPU wheel from this machine's find-links
  "$VENV/bin/pip" install -q "$REPO"         # bare: no extras
else
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "$REPO"  # a reused venv: this tree's package
fi
cp "$REPO/configs/quickstart.yaml" "$WORK/"
cd "$WORK"
LDT="$VENV/bin/lightning-disttrain"
"$LDT" fit --config quickstart.yaml --trainer.max_steps 4 --trainer.val_check_interval 4 \
  --trainer.limit_val_batches 2 --trainer.enable_progress_bar false --data.init_args.max_docs 100 \
  --trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint \
  --trainer.callbacks.dirpath runs/smoke --trainer.callbacks.every_n_train_steps 4 \
  --trainer.callbacks.save_last link
"$LDT" plan --model tiny --gpu cpu --gpu-memory 8 --gpus-per-node 2 --seq-len 128 --global-batch 16
"$LDT" export runs/smoke/last.ckpt model.pt
"$LDT" eval model.pt --tasks piqa,lambada_openai --limit 8 --output evals.json
# Fault tolerance needs the [ft] extra (torchft: Linux x86_64 wheels only): a bare install says so in one line.
if ! "$VENV/bin/python" -c "import torchft" 2>/dev/null; then
  "$LDT" ft-local --config quickstart.yaml > ft.txt 2>&1 && { echo "ft-local ran without torchft"; exit 1; }
  grep -q "pip install 'lightning-disttrain\[ft\]'" ft.txt || { cat ft.txt; exit 1; }
fi
"$VENV/bin/python" -c "import json; r = json.load(open('evals.json')); assert 'piqa' in r['metrics'], r; print('bare install: ok')"
