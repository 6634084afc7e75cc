#!/usr/bin/env bash
# Fuzzes the record decoder (and the message builder behind it), then the whole record path
# with structure-aware documents (hostile_record), with cargo fuzz for SECONDS each (default
# 60). Installs cargo-fuzz when missing. libFuzzer needs unstable compiler flags; RUSTC_BOOTSTRAP=1 lets this machine's one stable toolchain pass them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
SECONDS_TO_RUN="${1:-60}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --version 0.13.2 --locked --quiet
fi
mkdir -p fuzz/corpus/decode_record fuzz/corpus/hostile_record
RUSTC_BOOTSTRAP=1 cargo fuzz run decode_record fuzz/corpus/decode_record fuzz/seeds/decode_record \
  -- -max_total_time="$SECONDS_TO_RUN" -print_final_stats=1 2>&1 | tail -n 12
# Structure-aware: the bytes choose a Timeouts document of the right shape (see the target).
RUSTC_BOOTSTRAP=1 cargo fuzz run hostile_record fuzz/corpus/hostile_record \
  -- -max_total_time="$SECONDS_TO_RUN" -max_len=8192 -print_final_stats=1 2>&1 | tail -n 12
