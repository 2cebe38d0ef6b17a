# deepinfer-server: `docker run -p 8000:8000 deepinfer-server` serves the embedded `default`
# model (random weights, real architecture and tokenizer); `docker run --gpus all ...` serves it
# on the GPU (`--device auto` picks CUDA when one is visible). For real weights mount a checkpoint
# folder and pass it: `docker run -v /models/v41:/model -p 8000:8000 deepinfer-server --model /model`.
#
# Build arguments:
#   TORCH=cuda  (default) torch from PyPI: the CUDA build, which also runs without a GPU
#   TORCH=cpu   torch from PyTorch's CPU wheel index (CPU_TORCH_INDEX_URL): a much smaller image
FROM python:3.11-slim

ARG TORCH=cuda
ARG CPU_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    DEEPINFER_CACHE_DIR=/cache

# The server runs as this user; it owns the checkpoint cache (and its home holds Triton's cache).
RUN useradd --create-home --uid 1000 deepinfer \
    && mkdir /cache \
    && chown deepinfer:deepinfer /cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY recipe ./recipe
COPY server ./server
COPY loadtest ./loadtest
COPY scripts ./scripts

# The same install script CI runs (it prints its steps).
RUN case "$TORCH" in \
        cuda) index= ;; \
        cpu) index="$CPU_TORCH_INDEX_URL" ;; \
        *) echo "TORCH must be cuda or cpu, not $TORCH" >&2; exit 1 ;; \
    esac \
    && TORCH_INDEX_URL="$index" bash scripts/install.sh

USER deepinfer
# The embedded checkpoint is generated now, owned by the server's user (progress on stderr).
RUN python -c "import logging; logging.basicConfig(level=logging.INFO); \
from engine.models.embedded import ensure_embedded_checkpoint; ensure_embedded_checkpoint('default')"

EXPOSE 8000
# /health answers 200 once the model is loaded and the engine runs (503 before and after).
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["deepinfer-server", "--host", "0.0.0.0", "--port", "8000"]
