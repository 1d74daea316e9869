#!/usr/bin/env bash
# One device call after the vLLM pieces are in place (../shared/gpu/README.md), from the repo root:
#   bash bench/kernels/run_device.sh COMMIT
# GPU tests, then the benchmark tuning our op on vLLM's own inputs (--tune writes
# kernels/configs/moe_lora_<gpu>.json) and timing both ops; logs, configs and rows under $OUT.
set -uo pipefail
commit=$1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site/_pytest ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout 260 python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu \
  tests/kernels/test_moe_lora_gpu.py tests/kernels/test_lora_dense_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
[ "${SKIP_BENCH:-0}" = 1 ] || timeout 380 python3 bench/kernels/bench_moe_lora.py --tune --commit "$commit" --out "$OUT" 2>&1 \
  | tee "$OUT/bench.log"
cp kernels/configs/*.json "$OUT/configs_$(basename kernels/configs/*.json)" 2>/dev/null
