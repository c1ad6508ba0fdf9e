#!/bin/bash
# Issue 15's GPU checks as one command, for a session lent a device machine (docs/benchmarks.md §6, "On a GPU").
#
# That machine has PyTorch with CUDA but an older transformers without the reference model, and no network, so
# the reference travels as a wheel. Prepare it here once (pip reaches the index from here, not from there):
#   echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl transformers==5.23.0
# then run `bash scripts/gpu_check.sh` there with `.whl` carried (about 5 minutes on an H200). Without a GPU the
# tests skip and the benchmarks are not run. Everything lands in $OUT (the device tool's folder), or in
# results/gpu-check/ elsewhere: one log, and each benchmark's .json, .png and profile (7 files).
#   1. tests/test_cuda.py: logits and seeded tokens against the reference on the GPU, float32; greedy
#      speculative equals AR; bfloat16 in every mode;
#   2. bench/engine_speed.py --size 1b --device cuda --dtype bfloat16: the engine against the reference on a
#      1.0B-parameter random config (tokens/s, tokens per forward, decoder cost per canvas length);
#   3. the same for the 10.9M `small` config in float32, where the tokens can be compared one for one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
python3 -c "import transformers.models.diffusion_gemma" 2>/dev/null \
  || { echo "gpu_check: this transformers has no diffusion_gemma; carry transformers==5.23.0 as a wheel (see the top of this script)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'transformers', transformers.__version__)"

status=0
echo "== 1. tests/test_cuda.py"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs || status=1
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== 2. engine against the reference, 1.0B parameters, bf16"
  timeout 360 python3 bench/engine_speed.py --size 1b --device cuda --dtype bfloat16 --out "$OUT/engine_speed_1b.json" || status=1
  echo "== 3. engine against the reference, 10.9M parameters, float32"
  timeout 180 python3 bench/engine_speed.py --size small --device cuda --out "$OUT/engine_speed_small_cuda.json" || status=1
fi
echo "gpu_check: exit $status"
exit $status
