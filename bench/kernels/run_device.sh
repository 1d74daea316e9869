#!/usr/bin/env bash
# One device call after the vLLM pieces are in place (../shared/gpu/README.md), from the repo root:
#   bash bench/kernels/run_device.sh STEP COMMIT     STEP: tests+tune | bench
# Writes logs, tuned configs and JSON rows under $OUT.
set -uo pipefail
step=$1 commit=$2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site/_pytest ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_$step.txt"
if [ "$step" = "tests+tune" ]; then
  timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu \
    tests/kernels/test_moe_lora_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  timeout 290 python3 -m loraplex.kernels.tune_moe_lora 2>&1 | tee "$OUT/tune.log"
  cp kernels/configs/*.json "$OUT/" 2>/dev/null
else
  timeout 560 python3 bench/kernels/bench_moe_lora.py --commit "$commit" --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log"
fi
