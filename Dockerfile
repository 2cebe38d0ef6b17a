# deepinfer-server: `docker run -p 8000:8000 deepinfer-server` serves the embedded `default`
# model (random weights, real architecture and tokenizer). For real weights mount a checkpoint
# folder and pass it: `docker run -v /models/v41:/model -p 8000:8000 deepinfer-server --model /model`.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY recipe ./recipe
COPY server ./server
COPY scripts ./scripts

# The same install script CI runs. Pass `--build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index>`
# for a small CPU-only image; without it pip takes torch 2.13.0 from the default index.
ARG TORCH_INDEX_URL=
ENV DEEPINFER_CACHE_DIR=/cache
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" bash scripts/install.sh \
    && python -c "from engine.models.embedded import ensure_embedded_checkpoint as e; e('default')"

EXPOSE 8000
ENTRYPOINT ["deepinfer-server", "--host", "0.0.0.0", "--port", "8000"]
