#!/usr/bin/env bash
# The main job, end to end, on a fresh machine: starts a test MongoDB when no MongoDB URI is
# given, checks RabbitMQ, schedules a handful of timeouts a few seconds ahead with
# `timeoutd schedule`, and runs `timeoutd run` so you can watch them fire.
#
# Environment: TIMEOUTD_MONGODB__URI (default: a test MongoDB started here: secantusd-rs
#                when it is built, else SecantusDB's Python server secantusd-py, which
#                installs in seconds where secantusd-rs takes minutes to build),
#              DEMO_SERVER=python to use secantusd-py even when secantusd-rs is built,
#              TIMEOUTD_RABBITMQ__URI (default: amqp://guest:guest@127.0.0.1:5672/%2f),
#              DEMO_QUEUE (default: timeoutd-demo), DEMO_COUNT (default: 5),
#              DEMO_KEEP_RUNNING=1 to leave the daemon running until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

queue="${DEMO_QUEUE:-timeoutd-demo}"
count="${DEMO_COUNT:-5}"
work="$(mktemp -d -t timeoutd-demo.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/mongo/pid" ] && kill "$(cat "$work/mongo/pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "== building timeoutd"
cargo build --quiet --bin timeoutd --example consume
bin=target/debug/timeoutd

if [ -z "${TIMEOUTD_MONGODB__URI:-}" ]; then
  if command -v secantusd-rs >/dev/null 2>&1 && [ "${DEMO_SERVER:-}" != "python" ]; then
    echo "== no TIMEOUTD_MONGODB__URI: starting the test MongoDB (secantusd-rs)"
    TIMEOUTD_MONGODB__URI="$(scripts/start-test-mongodb.sh "$work/mongo")"
  else
    echo "== no TIMEOUTD_MONGODB__URI and secantusd-rs is not built (scripts/test.sh builds it,"
    echo "   about six minutes): starting SecantusDB's Python server, secantusd-py, instead"
    TIMEOUTD_MONGODB__URI="$(scripts/start-secantus-py.sh "$work/mongo")"
  fi
  export TIMEOUTD_MONGODB__URI
  export TIMEOUTD_MONGODB__DATABASE="${TIMEOUTD_MONGODB__DATABASE:-RMessageBusPersistantStore}"
fi
echo "   MongoDB: $TIMEOUTD_MONGODB__URI"

echo "== checking RabbitMQ"
scripts/ensure-rabbitmq.sh
rabbit="${TIMEOUTD_RABBITMQ__URI:-amqp://guest:guest@127.0.0.1:5672/%2f}"

echo "== consuming queue $queue (what a ServiceConnect service would receive)"
target/debug/examples/consume "$queue" "$rabbit" &
pids+=($!)
sleep 1

echo "== scheduling $count timeouts, due 2 to $((count + 1)) seconds from now"
for i in $(seq 1 "$count"); do
  id=$("$bin" schedule --destination "$queue" --correlation-id "$(cat /proc/sys/kernel/random/uuid)" \
        --in "$((i + 1))s" --header "Demo=timeout-$i")
  echo "   scheduled $id in $((i + 1))s"
done
"$bin" stats

echo "== running timeoutd (Ctrl-C stops it)"
"$bin" run &
daemon=$!
pids+=("$daemon")
if [ "${DEMO_KEEP_RUNNING:-0}" = "1" ]; then
  wait "$daemon"
else
  sleep "$((count + 4))"
  kill -TERM "$daemon"
  wait "$daemon" || true
  echo "== after the run"
  "$bin" stats
fi
