#!/usr/bin/env bash
# Installs SecantusDB's Python server, secantusd-py (PyPI SecantusDB, pinned below), into the
# virtualenv .tools/secantus-py (gitignored), for scripts/start-secantus-py.sh: the demo's
# MongoDB when secantusd-rs is not built, and the MongoDB TLS test's server (secantusd-py
# serves TLS). Idempotent: does nothing when this version is installed. Quiet: prints one
# line while installing, pip's log on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SECANTUS_PY_VERSION="0.7.0b3"
venv=.tools/secantus-py
python=${PYTHON:-python3}

if [ "$(cat "$venv/.installed" 2>/dev/null)" = "$SECANTUS_PY_VERSION" ] \
  && [ -x "$venv/bin/secantusd-py" ]; then
  exit 0
fi
echo "install-secantus-py: installing SecantusDB $SECANTUS_PY_VERSION from PyPI into $venv" >&2
mkdir -p .tools
log=.tools/install-secantus-py.log
if ! {
  rm -rf "$venv" \
    && "$python" -m venv "$venv" \
    && "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
      "SecantusDB==$SECANTUS_PY_VERSION" \
    && "$venv/bin/secantusd-py" --help
} >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-secantus-py: failed; the log above is also in $log" >&2
  exit 1
fi
echo "$SECANTUS_PY_VERSION" >"$venv/.installed"
rm -f "$log"
