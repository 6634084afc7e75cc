#!/usr/bin/env bash
# Installs the test MongoDB, SecantusDB's Rust server (secantusd-rs), if it is not on PATH.
# A MongoDB-wire-compatible server on WiredTiger; about 6 minutes to build the first time.
set -euo pipefail

SECANTUS_VERSION="0.5.3-beta.196"
export PATH="$HOME/.cargo/bin:$PATH"

if command -v secantusd-rs >/dev/null 2>&1; then
  exit 0
fi
if ! command -v cmake >/dev/null 2>&1; then
  echo "install-test-mongodb: installing cmake" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq cmake >/dev/null
fi
echo "install-test-mongodb: building secantusd-rs $SECANTUS_VERSION (a few minutes, once)" >&2
# The crate declares a newer rustc than it needs; it builds with this toolchain.
cargo install secantus-mdb --version "$SECANTUS_VERSION" --ignore-rust-version --locked --quiet
command -v secantusd-rs >/dev/null
