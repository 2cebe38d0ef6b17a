#!/usr/bin/env bash
# Run the real coding-agent CLIs against the server for one bounded turn each (issue 14).
#
#   scripts/agents_e2e.sh                 # scratch dir from mktemp
#   AGENTS_DIR=/tmp/agents-e2e scripts/agents_e2e.sh   # reuse installed CLIs between runs
#
# Installs Claude Code and Codex CLI (pinned) with npm into $AGENTS_DIR, starts the server
# (`default` random-weight model; short outputs), puts a logging proxy (scripts/agents_proxy.py)
# in front of it, runs `claude -p` and `codex exec` through the proxy, and prints every request
# with its status and stream events, then whether each run ended without a protocol error.
# Bounded: every step runs under `timeout`. Needs node/npm and the project venv.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
CLAUDE_VERSION=2.1.332
CODEX_VERSION=0.171.0
MODEL=DeepSeek-V4.1-Flash
AGENTS_DIR=${AGENTS_DIR:-$(mktemp -d /tmp/agents-e2e.XXXXXX)}
SERVER_PORT=${SERVER_PORT:-18201}
PROXY_PORT=${PROXY_PORT:-18202}
TURN_TIMEOUT=${TURN_TIMEOUT:-300}
MAX_TOKENS=${MAX_TOKENS:-24}
mkdir -p "$AGENTS_DIR"/{home,work,codexhome,logs}
LOG=$AGENTS_DIR/logs
: >"$LOG/proxy.jsonl"

echo "== install (npm, pinned) into $AGENTS_DIR"
if [ ! -x "$AGENTS_DIR/node_modules/.bin/claude" ] || [ ! -x "$AGENTS_DIR/node_modules/.bin/codex" ]; then
  timeout 600 npm install --prefix "$AGENTS_DIR" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_VERSION" "@openai/codex@$CODEX_VERSION" \
    >"$LOG/npm.log" 2>&1 || { echo "npm install failed (see $LOG/npm.log)"; exit 1; }
fi
BIN=$AGENTS_DIR/node_modules/.bin

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

echo "== server on :$SERVER_PORT (outputs capped at $MAX_TOKENS tokens: random weights)"
PYTHONPATH=$ROOT timeout $((TURN_TIMEOUT * 3)) "$PY" -m server --model default \
  --port "$SERVER_PORT" --default-max-tokens "$MAX_TOKENS" --max-tokens-limit "$MAX_TOKENS" \
  --grammar-compile-timeout 30 >"$LOG/server.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$SERVER_PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$SERVER_PORT/health" >/dev/null || { echo "server did not start"; tail "$LOG/server.log"; exit 1; }
PYTHONPATH=$ROOT "$PY" scripts/agents_proxy.py --upstream "http://127.0.0.1:$SERVER_PORT" \
  --port "$PROXY_PORT" --log "$LOG/proxy.jsonl" >"$LOG/proxy.log" 2>&1 &
PIDS+=($!)
sleep 2
PROXY=http://127.0.0.1:$PROXY_PORT

echo "== claude $CLAUDE_VERSION: one turn"
cd "$AGENTS_DIR/work"
HOME=$AGENTS_DIR/home ANTHROPIC_BASE_URL=$PROXY ANTHROPIC_API_KEY=unused \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
  ANTHROPIC_MODEL=$MODEL ANTHROPIC_SMALL_FAST_MODEL=$MODEL \
  timeout "$TURN_TIMEOUT" "$BIN/claude" -p "Say hi" --max-turns 2 </dev/null >"$LOG/claude.out" 2>&1
CLAUDE_RC=$?
echo "claude exit $CLAUDE_RC" >>"$LOG/claude.out"
MARK=$(wc -l <"$LOG/proxy.jsonl")

echo "== codex $CODEX_VERSION: one turn"
cat >"$AGENTS_DIR/codexhome/config.toml" <<EOF
model = "$MODEL"
model_provider = "deepinfer"
[model_providers.deepinfer]
name = "deepinfer"
base_url = "$PROXY/v1"
wire_api = "responses"
env_key = "DEEPINFER_API_KEY"
EOF
HOME=$AGENTS_DIR/home CODEX_HOME=$AGENTS_DIR/codexhome DEEPINFER_API_KEY=unused \
  timeout "$TURN_TIMEOUT" "$BIN/codex" exec --skip-git-repo-check "Say hi" </dev/null \
  >"$LOG/codex.out" 2>&1
CODEX_RC=$?
echo "codex exit $CODEX_RC" >>"$LOG/codex.out"
cd "$ROOT"
sleep 1

echo "== summary (logs in $LOG)"
"$PY" - "$LOG" "$MARK" "$CLAUDE_RC" "$CODEX_RC" <<'EOF'
import json, sys
log, mark, rcs = sys.argv[1], int(sys.argv[2]), {"claude": sys.argv[3], "codex": sys.argv[4]}
entries = [json.loads(line) for line in open(f"{log}/proxy.jsonl")]
runs = {"claude": entries[:mark], "codex": entries[mark:]}
for name, exchanges in runs.items():
    print(f"--- {name} (exit {rcs[name]})")
    errors = 0
    for e in exchanges:
        bad = e["status"] >= 400 or e.get("stream_errors")
        errors += bool(bad)
        events = e.get("events") or []
        print(f"  {e['method']} {e['path']}{'?' + e['query'] if e['query'] else ''} -> {e['status']}"
              f" tools={e.get('num_tools', '-')} {e.get('elapsed_s', '?')}s"
              f" events={events[:3] + ['...'] + events[-2:] if len(events) > 6 else events}")
        if bad:
            print(f"    ERROR {e.get('error') or e.get('stream_errors')}")
    tail = open(f"{log}/{name}.out").read().strip().splitlines()[-3:]
    verdict = "no protocol error" if exchanges and not errors else f"{errors} protocol error(s)"
    print(f"  {len(exchanges)} requests, {verdict}; CLI said: {' | '.join(tail)[:400]}")
EOF
