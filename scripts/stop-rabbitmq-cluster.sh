#!/usr/bin/env bash
# Stops the nodes scripts/start-rabbitmq-cluster.sh started in DIR (only those: by their pid
# files) and removes DIR.
set -uo pipefail
DIR="${1:?usage: stop-rabbitmq-cluster.sh DIR}"
[ -f "$DIR/nodes" ] || exit 0
while read -r node _; do
  timeout 30 rabbitmqctl -q -n "$node" stop </dev/null >/dev/null 2>&1 &
done < "$DIR/nodes"
wait
for pidfile in "$DIR"/*/pid; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  [[ "$pid" =~ ^[0-9]+$ ]] && kill "$pid" 2>/dev/null
done
for pidfile in "$DIR"/*/pid; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -9 "$pid" 2>/dev/null
done
rm -rf "$DIR"
