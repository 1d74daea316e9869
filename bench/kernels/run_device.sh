#!/usr/bin/env bash
# One device call after the vLLM pieces are in place (../shared/gpu/README.md), from the repo root:
#   bash bench/kernels/run_device.sh COMMIT [tests] [prefill] [moe]
# tests: the GPU tests under tests/kernels on 8 pytest-xdist workers (carry .whl: pytest,
# pytest-xdist and pytest-reportlog, installed into /tmp/site once per machine; pip's --target
# would replace /tmp/site's folders of the same name, so never again over vLLM's set-up); prefill:
# bench_lora_prefill (align and dense LoRA at prefill sizes, ours against vLLM's); moe:
# bench_moe_lora tuning our op on vLLM's own inputs (--tune writes
# kernels/configs/moe_lora_<gpu>.json; MOE_BATCHES limits the batches) and timing both ops.
# No part named: all three. Logs, configs and rows under $OUT.
set -uo pipefail
commit=$1
shift
parts=${*:-tests prefill moe}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/pytest_reportlog ]; then
  compgen -G ".whl/*.whl" >/dev/null || { echo "no wheels: carry .whl" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
for part in $parts; do
  case "$part" in
    tests)
      # The workers share the machine's cores (nproc without OMP_NUM_THREADS, which GNU nproc
      # obeys): on the H100 machine (16 cores) 8 workers whose torch each took every core for
      # the float64 references on the CPU ran 78 of 446 tests in 240 s (8924aae); with 2 threads
      # each, all 446 passed in 141 s (44d1aa1).
      # The report log keeps every test's time as it ends, also when the run is cut;
      # TESTS_PATHS narrows the files, TESTS_K selects by pytest's -k.
      workers=${TESTS_WORKERS:-8}
      if ! [[ $workers =~ ^[1-9][0-9]*$ ]]; then
        echo "TESTS_WORKERS must be a count >= 1, got $workers" >&2
        exit 2
      fi
      threads=$(($(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / workers))
      # shellcheck disable=SC2086  # TESTS_PATHS is a list of paths
      OMP_NUM_THREADS=$((threads > 0 ? threads : 1)) timeout "${TESTS_LIMIT_S:-420}" \
        python3 -m pytest -q --noconftest -p no:cacheprovider -p no:benchmark -m gpu \
        -n "$workers" --report-log "$OUT/gpu_tests.jsonl" ${TESTS_K:+-k "$TESTS_K"} \
        ${TESTS_PATHS:-tests/kernels} 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -6
      python3 -m bench.kernels.test_times "$OUT/gpu_tests.jsonl" | tee -a "$OUT/gpu_tests.log" ;;
    prefill)
      timeout 300 python3 bench/kernels/bench_lora_prefill.py --commit "$commit" --out "$OUT" 2>&1 \
        | tee "$OUT/bench_prefill.log" ;;
    moe)
      # shellcheck disable=SC2086  # MOE_BATCHES is a list of numbers
      timeout 450 python3 bench/kernels/bench_moe_lora.py --tune --commit "$commit" --out "$OUT" \
        ${MOE_BATCHES:+--batches $MOE_BATCHES} 2>&1 | tee "$OUT/bench.log"
      # The tuner writes into the package it imports (/tmp/site's copy, not this tree's).
      configs=$(python3 -c 'from loraplex.kernels.ops.moe_lora import configs; print(configs.CONFIG_DIR)')
      for f in "$configs"/*.json; do cp "$f" "$OUT/configs_$(basename "$f")"; done ;;
  esac
done
