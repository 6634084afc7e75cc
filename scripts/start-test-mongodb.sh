#!/usr/bin/env bash
# Starts secantusd-rs on a free port with its data in DIR (default: a new temporary directory)
# and prints its URI, mongodb://127.0.0.1:PORT/. The server's pid is written to DIR/pid.
# Usage: scripts/start-test-mongodb.sh [DIR]
set -euo pipefail
export PATH="$HOME/.cargo/bin:$PATH"

dir="${1:-$(mktemp -d -t timeoutd-mongo.XXXXXX)}"
mkdir -p "$dir"
"$(dirname "$0")/install-test-mongodb.sh"
secantusd-rs --port 0 --log-level WARNING --storage-path "$dir/data" >"$dir/server.log" 2>&1 &
echo $! >"$dir/pid"
for _ in $(seq 1 100); do
  if addr=$(grep -o 'listening on [0-9.:]*' "$dir/server.log" 2>/dev/null); then
    echo "mongodb://${addr#listening on }/"
    exit 0
  fi
  kill -0 "$(cat "$dir/pid")" 2>/dev/null || break
  sleep 0.1
done
echo "start-test-mongodb: secantusd-rs did not start; see $dir/server.log" >&2
exit 1
