#!/usr/bin/env bash
# Fuzzes the record decoder (and the message builder behind it), then the whole record path
# with structure-aware documents (hostile_record), with cargo fuzz for SECONDS each (default
# 60). Installs cargo-fuzz when missing. libFuzzer needs unstable compiler flags;
# RUSTC_BOOTSTRAP=1 lets this machine's one stable toolchain pass them.
# Each run's whole output goes to target/fuzz/<target>.log; on a failure the script prints
# libFuzzer's report (the lines from its first ERROR or panic on) and the crashing input.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
SECONDS_TO_RUN="${1:-60}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --version 0.13.2 --locked --quiet
fi
mkdir -p fuzz/corpus/decode_record fuzz/corpus/hostile_record target/fuzz

fuzz() {
  local target="$1"; shift
  local log="target/fuzz/$target.log"
  if RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "$@" >"$log" 2>&1; then
    tail -n 8 "$log"
    return 0
  fi
  echo "fuzz: $target FAILED; its report (whole log in $log):" >&2
  local from
  from=$(grep -n -m1 -E "ERROR|panicked|deadly signal|Fuzz target exited" "$log" | cut -d: -f1 || true)
  if [ -n "$from" ]; then
    sed -n "$((from > 20 ? from - 20 : 1)),$((from + 60))p" "$log" >&2
  else
    tail -n 80 "$log" >&2
  fi
  for f in fuzz/artifacts/"$target"/*; do
    [ -f "$f" ] || continue
    echo "crashing input $f:" >&2
    od -A d -t x1 "$f" | head -n 40 >&2
  done
  return 1
}

fuzz decode_record fuzz/corpus/decode_record fuzz/seeds/decode_record \
  -- -max_total_time="$SECONDS_TO_RUN" -print_final_stats=1
# Structure-aware: the bytes choose a Timeouts document of the right shape (see the target).
fuzz hostile_record fuzz/corpus/hostile_record \
  -- -max_total_time="$SECONDS_TO_RUN" -max_len=8192 -print_final_stats=1
