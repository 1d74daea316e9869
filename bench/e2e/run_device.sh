#!/usr/bin/env bash
# e2e device calls after the vLLM pieces are in place (../shared/gpu/README.md), from the repo root:
#   bash bench/e2e/run_device.sh COMMIT MODE...     MODE: check | base | stock | plugin
# check: greedy tokens with and without the plugin on a small real-weight MoE (bench_e2e.py);
# the others: the 16 x 1600/600 workload with a decode-step profile. JSON rows and a log in $OUT.
set -uo pipefail
commit=$1
shift
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log="$OUT/e2e_$(IFS=_; echo "$*").log"
for mode in "$@"; do
  if [ "$mode" = check ]; then
    for m in check-stock check-plugin; do
      timeout 240 python3 bench/e2e/bench_e2e.py "$m" --commit "$commit" --out "$OUT" \
        --install /tmp/site >>"$log" 2>&1
    done
    python3 bench/e2e/bench_e2e.py compare --commit "$commit" --out "$OUT" 2>&1 | tee -a "$log"
  else
    timeout 480 python3 bench/e2e/bench_e2e.py "$mode" --profile --commit "$commit" \
      --out "$OUT" --install /tmp/site >>"$log" 2>&1
  fi
  grep -E "RESULT|CHECK|loraplex MoE|Traceback|Error" "$log" | cut -c1-600 | tail -12
done
