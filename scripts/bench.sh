#!/usr/bin/env bash
# Runs the dispatch benchmark (issue 5): checks RabbitMQ, installs the test MongoDB server
# (secantusd-rs) unless TIMEOUTD_BENCH_MONGODB_URI names a MongoDB, then
# `cargo bench --bench dispatch`, which builds the release binary it runs, starts what it
# needs, prints a table and writes target/bench/dispatch.json.
#
# Knobs (environment): TIMEOUTD_BENCH_SCALE (1 = the issue's sizes, 0.1 for a quick run),
# TIMEOUTD_BENCH_MONGODB_URI, TIMEOUTD_BENCH_AMQP_URI, TIMEOUTD_BENCH_OUT,
# TIMEOUTD_BENCH_ONLY (comma-separated: raw,floors,baseline,timeoutd-1,timeoutd-3,
# lateness-timeoutd,lateness-baseline,claim,claim-paused,rss,history), TIMEOUTD_BENCH_SHAPE (v7, the
# default: v7's indexes on every collection; public: the public releases' records, no index).
# Extra arguments go to `cargo bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

if [ -z "${TIMEOUTD_BENCH_AMQP_URI:-}" ]; then
  scripts/ensure-rabbitmq.sh
fi
if [ -z "${TIMEOUTD_BENCH_MONGODB_URI:-}" ]; then
  scripts/install-test-mongodb.sh
fi
cargo bench --bench dispatch "$@"
