#!/usr/bin/env bash
# e2e device calls after the vLLM pieces are in place (../shared/gpu/README.md), from the repo root:
#   bash bench/e2e/run_device.sh COMMIT MODE...
#   MODE: check | poison | poison-{stock,plugin,stock-graphs,plugin-graphs} | base | stock | plugin
#         | prefill-base | prefill-stock | prefill-plugin | host-base | host-plugin | serve-plugin
#         | serve-stock | serve-tp | guard-gpu | guard-gpu-moe
#         | guard-gpu-dense | wheels
# check: greedy tokens on a small real-weight MoE, stock vLLM eager against the plugin eager and
# CUDA graphs per adapter count with and without the plugin (bench_e2e.py);
# poison: on that model, whether the requests beside a NaN copy of an adapter, and after it,
# keep their greedy tokens: stock and plugin, eager and CUDA graphs (poison_check.py), then
# poison-compare; poison-MODE runs one (poison-compare also runs off the device on the rows);
# base/stock/plugin: the 16 x 1600/600 workload offline, with a decode-step profile (prefill-*: one
# repetition and a profile of one prefill of the 16 prompts instead), and a count of
# the Triton compiles vLLM's jit_monitor saw while serving; host-*: one repetition, then py-spy's
# samples of 8 prefills and cProfile of 3 more, engine in process (where the host's time goes,
# host_samples.py); serve-*: the same workload through
# loraplex's HTTP server (serve_e2e.py; carry .gpu/p6, the server's dependency wheels:
# pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
# -d .gpu/p6 and the modules the loop below names); serve-tp (2 GPUs): greedy tokens through
# loraplex's server at tensor_parallel_size 2 against 1, base and adapters, plugin on
# (serve_tp.py).
# guard-gpu: tests/server/test_engine_guard_gpu.py (4 engines; -moe or -dense: that model's 2,
# e.g. one per GPU), which imports the server (carry .gpu/p6 as for serve-*); prints its
# GUARD-GPU lines (per case and sequence: positions compared, tie flips, differences, the
# smallest reference margin) and pytest's summary. wheels: only .gpu/p6's install, for modes
# started side by side on two GPUs afterwards (so that two installs do not race).
# JSON rows and one log per mode in $OUT.
set -uo pipefail
commit=$1
shift
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

source bench/e2e/server_wheels.sh
for mode in "$@"; do
  log="$OUT/e2e_$mode.log"
  case "$mode" in
    check)
      for m in check-stock check-plugin check-plugin-graphs check-stock-graphs; do
        timeout 240 python3 bench/e2e/bench_e2e.py "$m" --commit "$commit" --out "$OUT" \
          --install /tmp/site >>"$log" 2>&1
      done
      python3 bench/e2e/bench_e2e.py compare --commit "$commit" --out "$OUT" 2>&1 | tee -a "$log" ;;
    poison|poison-*)
      modes=$mode
      [ "$mode" = poison ] && modes="poison-stock poison-plugin poison-stock-graphs poison-plugin-graphs"
      [ "$mode" = poison-compare ] && modes=""
      for m in $modes; do
        timeout 240 python3 bench/e2e/bench_e2e.py "$m" --commit "$commit" --out "$OUT" \
          --install /tmp/site >>"$log" 2>&1
      done
      python3 bench/e2e/bench_e2e.py poison-compare --commit "$commit" --out "$OUT" 2>&1 \
        | tee -a "$log" ;;
    wheels)
      server_wheels /tmp/site
      continue ;;
    serve-tp)
      server_wheels /tmp/site
      timeout 560 python3 -m bench.e2e.serve_tp --commit "$commit" --out "$OUT" \
        --install /tmp/site >"$log" 2>&1 ;;
    serve-*)
      server_wheels /tmp/site
      timeout 560 python3 -m bench.e2e.serve_e2e --modes "${mode#serve-}" --commit "$commit" \
        --out "$OUT" --install /tmp/site >"$log" 2>&1 ;;
    guard-gpu|guard-gpu-*)
      server_wheels /tmp/site
      select=()
      [ "$mode" != guard-gpu ] && select=(-k "${mode#guard-gpu-}")
      timeout 560 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu \
        ${select[@]+"${select[@]}"} tests/server/test_engine_guard_gpu.py >"$log" 2>&1
      grep -E "^GUARD-GPU|passed|failed|[0-9]+ error" "$log" | cut -c1-300 | tail -70 ;;
    host-*)  # py-spy's wheel carried in .gpu/p5 (the device has no network)
      [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps \
        --target /tmp/pyspy .gpu/p5/py_spy-*.whl
      LORAPLEX_PYSPY=/tmp/pyspy/bin/py-spy timeout 560 python3 bench/e2e/bench_e2e.py \
        "${mode#host-}" --profile host --reps 1 --commit "$commit" --out "$OUT/$mode" \
        --install /tmp/site >"$log" 2>&1
      python3 bench/e2e/host_samples.py "$OUT/$mode/host.samples" \
        --row "$OUT/$mode/e2e_${mode#host-}-qwen3-30b-a3b.json" --out "$OUT/$mode/samples.json" 2>&1 \
        | tee -a "$log" | head -70 ;;
    prefill-*)
      timeout 480 python3 bench/e2e/bench_e2e.py "${mode#prefill-}" --profile prefill --reps 1 \
        --commit "$commit" --out "$OUT/$mode" --install /tmp/site >"$log" 2>&1 ;;
    *)
      timeout 480 python3 bench/e2e/bench_e2e.py "$mode" --profile decode --commit "$commit" \
        --out "$OUT" --install /tmp/site >"$log" 2>&1
      echo "$mode: Triton compiles while serving: $(grep -c 'JIT compilation during inference' "$log")"
      grep 'JIT compilation during inference' "$log" | grep -oE 'inference: [A-Za-z0-9_]+' | sort | uniq -c ;;
  esac
  grep -E "RESULT|CHECK|POISON|ROW|REP|JIT compilation during|loraplex MoE|Traceback|Error" "$log" \
    | cut -c1-600 | tail -16
done
