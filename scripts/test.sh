#!/usr/bin/env bash
# Runs the test suite against the real RabbitMQ and the test MongoDB.
# Installs secantusd-rs when it is missing; each test process starts its own server on a free
# port (about 0.15 s), or uses TIMEOUTD_TEST_MONGODB_URI (a real MongoDB) when it is set.
# cargo-nextest runs the tests of every binary side by side (.config/nextest.toml); extra
# arguments go to `cargo nextest run` (a filter such as `faults::`, or `--no-fail-fast`).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

scripts/ensure-rabbitmq.sh
if [ -z "${TIMEOUTD_TEST_MONGODB_URI:-}" ]; then
  scripts/install-test-mongodb.sh
fi
scripts/install-nextest.sh
scripts/install-validators.sh
scripts/install-prometheus.sh
scripts/install-grafana-validator.sh
scripts/install-secantus-py.sh
# The failpoints feature compiles the test-only failpoints in (see Cargo.toml). The benchmark
# is left out: under a test runner it only says how to run it.
# The simulation's default run takes two of nextest's six slots (.config/nextest.toml) and
# runs its seeds on two threads.
export SIMULATE_JOBS="${SIMULATE_JOBS:-2}"
run=(cargo nextest run --features failpoints --lib --bins --tests --examples)
if [ -z "${TIMEOUTD_TEST_MONGODB_URI:-}" ]; then
  "${run[@]}" "$@"
else
  # One server for every test process: the MongoDB conformance cases that set server-wide
  # faults (maxTimeAlwaysTimeOut, a stepdown) run afterwards, on their own, where they cannot
  # reach another test's calls.
  "${run[@]}" -E 'not binary(conformance_mongodb)' "$@"
  cargo test --features failpoints --test conformance_mongodb
fi
