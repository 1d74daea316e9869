#!/usr/bin/env bash
# Issue 43's measurements in one GPU session, one device call per PART, each under 600 s: on the
# 2-GPU kind GPU 0 and GPU 1 run their lists side by side; on a 1-GPU kind, LANE (0 or 1) names
# the list to run on its one GPU. With LANE, the part's work folder is kept between calls on one
# machine, so a second lane's call compares and collects both lanes' runs (its file holds both:
# commit that one); e needs two GPUs, and c with LANE leaves out its TP=2 tail. vLLM's pieces p1-p3 must be in
# /tmp/vchunks (../shared/gpu/README.md); carry .gpu/p4 in the first part's call, which joins
# them into /tmp/site (its ~30 s count in the part's budget), and .gpu/p6 in d and f's (the
# server's wheels; p4 and p6 together pass the 64 MiB a call carries, so before a first part d
# or f, set vLLM up in a call of its own: bash .gpu/p4/setup-on-device.sh). From the repository
# root:
#   bash bench/e2e/run_session.sh COMMIT PART [LANE]
# PART, most important first (seconds: estimates on a cold H200 machine, docs/bench.md):
#   a  decode, Qwen3 shape base + plugin (3 reps) | GPT-OSS shape base + plugin (3 reps)
#   b  the check (small real-weight MoE), eager on GPU 0 and CUDA graphs on GPU 1, each beside
#      an engine started without LoRA (base untouched); then decode, stock on both shapes
#   c  n-gram speculative decoding with and without the plugin (graphs); then TP=2 check
#   d  through the server, Qwen3 shape: loraplex + plugin | vLLM's own server, base and stock
#      (VLLM_SERVERS, "vllm-base vllm-stock" by default, names lane 1's servers and their order)
#   e  decode at TP=2, Qwen3 shape, base + plugin (2 reps)
#   f  through the server, GPT-OSS shape (as d)
#   g  decode anatomy: the plugin with a decode-step profile, GPT-OSS shape on GPU 0, then
#      GPT-OSS base with one if the budget allows | Qwen3 shape on GPU 1 (a profiled run takes
#      ~60 s past its repetitions; Qwen3 base's profile is of record, f0f8dcd)
#   t  decode with vLLM's LoRA on the adapters' modules only (shapes.ADAPTER_TARGETS, no router
#      LoRA): plugin, then stock, GPT-OSS shape on GPU 0 | Qwen3 shape on GPU 1; ratios over
#      part a's base rows of the same machine hold
#   k  n-gram speculative decoding, plugin (with and without) and base, on GPU 0 | the GPU
#      kernel tests on GPU 1 (bench/kernels/run_device.sh tests: carry .whl); the TP=2 check is
#      part c's
#   s  speculative decoding with a draft model (the check model drafting for itself): the plugin
#      without and with it, base with it, on GPU 0 | the same on GPU 1, eager
# Out: $OUT/e2e_session_PART.jsonl (every row: machine, commit, model, mode, start-up split),
# $OUT/e2e_session_PART.log (the summary, and each failed run's last lines); the summary and
# a DONE line per run on stdout. Every engine runs under `timeout`, never past the part's
# BUDGET_S (570 by default) from the script's start.
set -uo pipefail
commit=$1
part=$2
only_lane=${3:-}
case "$only_lane" in
  "" | 0 | 1) ;;
  *) echo "LANE must be 0 or 1, got $only_lane" >&2; exit 2 ;;
esac
if [ -n "$only_lane" ] && [ "$part" = e ]; then
  echo "part e runs at TP=2: it needs two GPUs, not a LANE" >&2
  exit 2
fi
site=${SITE:-/tmp/site}
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-570}
work=${WORK:-/tmp/e2e_session}/$part
[ -z "$only_lane" ] && rm -rf "$work"
mkdir -p "$work" "$OUT"
report="$OUT/e2e_session_$part.log"
t0=$SECONDS
if [ ! -d "$site/vllm" ]; then
  bash .gpu/p4/setup-on-device.sh || { echo "no vLLM in $site: carry .gpu/p4" >&2; exit 1; }
  echo "vLLM set up in $((SECONDS - t0)) s" | tee -a "$report"
fi

# engine LABEL LIMIT_S CMD...: CMD's output in $work/LABEL.log, killed after LIMIT_S or at the
# part's budget, whichever comes first; a failed run's last lines go to the report.
engine() {
  local label=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - t0)))
  ((left < limit)) && limit=$left
  if ((limit < 30)); then
    echo "SKIP $label: ${left} s of the budget left" | tee -a "$report"
    return
  fi
  local log="$work/$label.log" start=$SECONDS rc
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "DONE $label rc=$rc $((SECONDS - start)) s (at $((SECONDS - t0)) s)" | tee -a "$report"
  if ((rc != 0)); then
    grep -E "Error|error:|Traceback" "$log" | cut -c1-300 | tail -5 >>"$report"
    tail -n 15 "$log" | cut -c1-300 >>"$report"
  fi
}

# bench LABEL LIMIT_S ARGS...: bench_e2e.py with ARGS, its rows into $work.
bench() {
  local label=$1 limit=$2
  shift 2
  engine "$label" "$limit" python3 bench/e2e/bench_e2e.py "$@" --commit "$commit" \
    --out "$work" --install "$site" --log "$work/$label.log"
}

# serve LABEL ARGS...: serve_e2e.py with ARGS (its own start timeout within the budget).
serve() {
  local label=$1
  shift
  local left=$((BUDGET_S - (SECONDS - t0) - 20))
  engine "$label" $((left + 20)) python3 -m bench.e2e.serve_e2e "$@" --commit "$commit" \
    --out "$work" --install "$site" --requests 32 --start-timeout "$left"
}

# lanes: the part's lists, lane0 and lane1, side by side on GPUs 0 and 1; with LANE, that one
# alone on GPU 0.
lanes() {
  if [ -n "$only_lane" ]; then
    (export CUDA_VISIBLE_DEVICES=0 && "lane$only_lane")
  else
    (export CUDA_VISIBLE_DEVICES=0 && lane0) &
    (export CUDA_VISIBLE_DEVICES=1 && lane1) &
    wait
  fi
}

source bench/e2e/server_wheels.sh

qwen=(--model qwen3-30b-a3b)
oss=(--model gpt-oss-20b)
case "$part" in
  a)
    lane0() {
      bench base-qwen 300 base "${qwen[@]}"
      bench plugin-qwen 300 plugin "${qwen[@]}"
    }
    lane1() {
      bench base-oss 280 base "${oss[@]}"
      bench plugin-oss 300 plugin "${oss[@]}"
    }
    lanes ;;
  b)
    lane0() {
      for m in check-base check-plugin check-stock; do bench "$m" 120 "$m"; done
      bench stock-qwen 330 stock "${qwen[@]}"
    }
    lane1() {
      for m in check-base-graphs check-plugin-graphs check-stock-graphs; do
        bench "$m" 150 "$m"
      done
      bench stock-oss 300 stock "${oss[@]}"
    }
    lanes ;;
  c)
    lane0() {
      bench check-plugin-graphs 150 check-plugin-graphs
      bench check-plugin-graphs-ngram 150 check-plugin-graphs --spec ngram
    }
    lane1() {
      bench check-base-graphs 150 check-base-graphs
      bench check-base-graphs-ngram 150 check-base-graphs --spec ngram
    }
    lanes
    if [ -z "$only_lane" ]; then
      export CUDA_VISIBLE_DEVICES=0,1
      bench check-stock-tp2 150 check-stock --tp 2
      bench check-plugin-graphs-tp2 180 check-plugin-graphs --tp 2
      bench check-base-graphs-tp2 150 check-base-graphs --tp 2
    fi ;;
  d | f)
    server_wheels "$site"
    model=("${qwen[@]}")
    [ "$part" = f ] && model=("${oss[@]}")
    lane0() {
      serve serve-plugin --modes plugin "${model[@]}" --root /tmp/e2e_serve0
    }
    lane1() {
      # shellcheck disable=SC2086 # VLLM_SERVERS is a list of modes
      serve serve-vllm --modes ${VLLM_SERVERS:-vllm-base vllm-stock} "${model[@]}" \
        --root /tmp/e2e_serve1
    }
    lanes ;;
  e)
    export CUDA_VISIBLE_DEVICES=0,1
    bench base-qwen-tp2 280 base "${qwen[@]}" --tp 2 --reps 2
    bench plugin-qwen-tp2 290 plugin "${qwen[@]}" --tp 2 --reps 2 ;;
  g)
    prof=(--profile decode)
    lane0() {
      bench plugin-oss 330 plugin "${oss[@]}" "${prof[@]}"
      bench base-oss 330 base "${oss[@]}" "${prof[@]}"
    }
    lane1() {
      bench plugin-qwen 360 plugin "${qwen[@]}" "${prof[@]}"
    }
    lanes ;;
  t)
    targets=(--lora-targets $(python3 -c 'from bench.e2e.shapes import ADAPTER_TARGETS as t; print(*t)'))
    lane0() {
      bench plugin-oss-targets 300 plugin "${oss[@]}" "${targets[@]}"
      bench stock-oss-targets 300 stock "${oss[@]}" "${targets[@]}"
    }
    lane1() {
      bench plugin-qwen-targets 300 plugin "${qwen[@]}" "${targets[@]}"
      bench stock-qwen-targets 300 stock "${qwen[@]}" "${targets[@]}"
    }
    lanes ;;
  k)
    # The plugin with and without speculation (greedy agreement), base with it (step time).
    lane0() {
      bench check-plugin-graphs 150 check-plugin-graphs
      bench check-plugin-graphs-ngram 150 check-plugin-graphs --spec ngram
      bench check-base-graphs-ngram 120 check-base-graphs --spec ngram
    }
    lane1() {
      TESTS_LIMIT_S=410 engine kernel-tests 420 bash bench/kernels/run_device.sh "$commit" tests
      tail -n 3 "$work/kernel-tests.log" | tee -a "$report"
    }
    lanes ;;
  s)
    # As k's lane 0 with a draft model; lane 1 the same eagerly (the kernel tests are k's).
    draft() {
      local graphs=$1
      bench "check-plugin$graphs" 150 "check-plugin$graphs"
      bench "check-plugin$graphs-draft" 180 "check-plugin$graphs" --spec draft
      bench "check-base$graphs-draft" 150 "check-base$graphs" --spec draft
    }
    lane0() { draft -graphs; }
    lane1() { draft ""; }
    lanes ;;
  *)
    echo "unknown part $part (a b c d e f g t k s)" >&2
    exit 2 ;;
esac

if ls "$work"/e2e_check-*.json >/dev/null 2>&1; then
  python3 bench/e2e/bench_e2e.py compare --commit "$commit" --out "$work" >>"$report" 2>&1
fi
python3 -m bench.e2e.rows collect "$work" "$OUT/e2e_session_$part.jsonl" --part "$part"
python3 -m bench.e2e.rows summary "$OUT/e2e_session_$part.jsonl" | tee -a "$report"
echo "part $part: $((SECONDS - t0)) s"
