#!/usr/bin/env bash
# Starts SecantusDB's Python server, secantusd-py (PyPI SecantusDB), on a free
# port of 127.0.0.1 with its data in DIR (default: a new temporary directory), and prints its
# URI, mongodb://127.0.0.1:PORT/. The server's pid is written to DIR/pid, its log to
# DIR/server.log. Further arguments go to secantusd-py (e.g. its --tls-* flags).
# scripts/install-secantus-py.sh installs it first when needed (about 10 s, once); the demo
# uses it when secantusd-rs is not built yet, the MongoDB TLS test always.
# Usage: scripts/start-secantus-py.sh [DIR [secantusd-py flags...]]
set -euo pipefail

dir="${1:-$(mktemp -d -t timeoutd-mongo.XXXXXX)}"
shift || true
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
cd "$(dirname "$0")/.."
scripts/install-secantus-py.sh
venv=.tools/secantus-py

# INFO is the level at which it logs the port it listens on.
"$venv/bin/secantusd-py" --host 127.0.0.1 --port 0 --storage-path "$dir/data" \
  --log-level INFO "$@" >"$dir/server.log" 2>&1 &
echo $! >"$dir/pid"
for _ in $(seq 1 300); do
  if addr=$(grep -o 'listening on [0-9.:]*' "$dir/server.log" 2>/dev/null); then
    echo "mongodb://${addr#listening on }/"
    exit 0
  fi
  kill -0 "$(cat "$dir/pid")" 2>/dev/null || break
  sleep 0.1
done
echo "start-secantus-py: secantusd-py did not start; see $dir/server.log" >&2
exit 1
