#!/usr/bin/env bash
# The deterministic simulation of a fleet (issue 25): real daemons on models of MongoDB and
# RabbitMQ under a paused clock, faults drawn per seed, invariants checked on every step.
# Needs no server. Prints seeds run and seeds/second; for a failure the seed, its
# configuration, the first broken invariant and the trace leading to it, and shrinks it to a
# scenario file under tests/sim/regressions/ (replayed by every run).
#
#   scripts/simulate.sh                  # the default seed count (as `cargo test` runs it)
#   scripts/simulate.sh --seeds 5000     # more seeds; --from S starts at seed S
#   scripts/simulate.sh --seed 1234      # one seed, with its whole trace
#   scripts/simulate.sh --replay tests/sim/regressions/seed-1234-early.json
#   SIMULATE_RELEASE=1 scripts/simulate.sh --seeds 100000   # optimised build, for long runs
#
# Other options: --repeat K (seeds run twice to compare trace hashes, default 4),
# --no-shrink, --keep-going, --quiet. The same feature set as scripts/test.sh, so the build is
# shared with the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
profile=()
if [ -n "${SIMULATE_RELEASE:-}" ]; then
  profile=(--release)
fi
exec cargo test "${profile[@]}" --features failpoints --test simulate -- "$@"
