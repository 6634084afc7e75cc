#!/usr/bin/env bash
# Installs Debian's `prometheus` package (Prometheus 2.42 and `promtool`) when either is
# missing. tests/suite/metrics.rs runs `promtool check metrics` on live scrapes, tests/suite/alerts.rs
# runs `promtool check rules` and `promtool test rules`, and tests/suite/prometheus.rs starts a real
# `prometheus` on a free port. The package's own service is not started here (it is disabled
# and stopped right after the install when systemd runs), so nothing listens on :9090.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "install-prometheus: installing Debian's prometheus package (prometheus, promtool)" >&2
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  prometheus >/dev/null
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
command -v prometheus >/dev/null && command -v promtool >/dev/null
