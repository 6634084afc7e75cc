#!/usr/bin/env bash
# cargo-nextest, which scripts/test.sh runs the tests with: machines of this project's kind
# have it; elsewhere it is built from crates.io once (a few minutes).
set -euo pipefail
export PATH="$HOME/.cargo/bin:$PATH"
if cargo nextest --version >/dev/null 2>&1; then
  exit 0
fi
echo "install-nextest: building cargo-nextest 0.9.143 from crates.io (a few minutes, once)" >&2
cargo install cargo-nextest --version 0.9.143 --locked
