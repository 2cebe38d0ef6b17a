#!/usr/bin/env bash
# Start `deepinfer-server` from an environment's bin folder on a free port with an empty cache,
# wait (up to 10 minutes) until /health answers 200 (the image's HEALTHCHECK request), stop it.
#   scripts/serve_check.sh /path/to/env/bin [server args...]
set -euo pipefail
BIN=$1
shift
PORT=$("$BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
CACHE=$(mktemp -d)
DEEPINFER_CACHE_DIR="$CACHE" "$BIN/deepinfer-server" --port "$PORT" "$@" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$CACHE"' EXIT
for _ in $(seq 600); do
    if "$BIN/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=4)" 2>/dev/null; then
        echo "serve_check.sh: /health is 200 on port $PORT" >&2
        exit 0
    fi
    kill -0 "$SERVER" 2>/dev/null || { echo "serve_check.sh: the server exited" >&2; exit 1; }
    sleep 1
done
echo "serve_check.sh: /health never answered 200" >&2
exit 1
