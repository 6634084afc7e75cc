#!/usr/bin/env bash
# Installs what tests/suite/dashboard.rs needs to check config/grafana/timeoutd.json against
# Grafana's published dashboard schema: the npm packages pinned in
# scripts/validators/grafana/package-lock.json (@grafana/schema, typescript), into
# .tools/grafana (gitignored), from the npm registry. scripts/validate-grafana-dashboard.mjs
# then type-checks the dashboard with them, offline.
# Idempotent: does nothing when the same lock file is installed with the same Node.js.
# Quiet: prints nothing on success, npm's log on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=.tools/grafana
lock=scripts/validators/grafana/package-lock.json

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "install-grafana-validator: installing Node.js and npm (Debian)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    nodejs npm >/dev/null
fi
stamp="$(sha256sum "$lock" | cut -d' ' -f1) $(node --version)"
if [ -f "$dir/node_modules/@grafana/schema/package.json" ] \
  && [ -f "$dir/node_modules/typescript/package.json" ] \
  && [ "$(cat "$dir/.installed" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi

mkdir -p "$dir"
log=.tools/install-grafana-validator.log
if ! {
  rm -rf "$dir/node_modules" \
    && cp scripts/validators/grafana/package.json "$lock" "$dir/" \
    && (cd "$dir" && npm ci --no-audit --no-fund --ignore-scripts) \
    && node -e 'require(process.argv[1])' "$PWD/$dir/node_modules/typescript"
} >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-grafana-validator: failed; the log above is also in $log" >&2
  exit 1
fi
echo "$stamp" >"$dir/.installed"
rm -f "$log"
