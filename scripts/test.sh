#!/usr/bin/env bash
# Runs the test suite against the real RabbitMQ and the test MongoDB.
# Installs secantusd-rs when it is missing; the tests start their own server on a free port,
# or use TIMEOUTD_TEST_MONGODB_URI (a real MongoDB) when it is set.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

scripts/ensure-rabbitmq.sh
if [ -z "${TIMEOUTD_TEST_MONGODB_URI:-}" ]; then
  scripts/install-test-mongodb.sh
fi
scripts/install-validators.sh
scripts/install-prometheus.sh
scripts/install-grafana-validator.sh
scripts/install-secantus-py.sh
# The failpoints feature compiles the test-only failpoints in (see Cargo.toml).
cargo test --all-targets --features failpoints "$@"
