#!/usr/bin/env bash
# Runs every fault scenario and the soak (tests/faults.rs) one at a time and prints the
# The fault table of docs/guarantees.md: scenario, records, lost, duplicates (and how they are accounted for),
# lateness p99. Soak size: TIMEOUTD_SOAK_RECORDS (100000), TIMEOUTD_SOAK_SECONDS (180).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
scripts/ensure-rabbitmq.sh
[ -n "${TIMEOUTD_TEST_MONGODB_URI:-}" ] || scripts/install-test-mongodb.sh
out="$(mktemp)"
cargo test --features failpoints --test faults -- --include-ignored --nocapture --test-threads=1 2>&1 | tee "$out" >&2
echo
echo "| scenario | records | lost | duplicates | counted in lease_lost | held by a killed instance | lateness p99 |"
echo "|---|---|---|---|---|---|---|"
grep -o 'FAULTS .*' "$out" | sed -E 's/^FAULTS ([^:]+): /\1|/' | awk -F'|' '
  {
    scenario = $1; n = split($2, kv, " ");
    for (i = 1; i <= n; i++) { split(kv[i], p, "="); v[p[1]] = p[2] }
    lost = v["records"] - (v["deliveries"] - v["duplicates"]);
    printf "| %s | %s | %d | %s | %s | %s | %s ms |\n", scenario, v["records"], lost, v["duplicates"], v["lease_lost"], v["killed_held"], v["lateness_p99_ms"]
  }'
grep -o 'SOAK .*' "$out" || true
# Hostile records beside ordinary ones (tests/hostile.rs), one daemon.
cargo test --features failpoints --test hostile -- --nocapture --test-threads=1 2>&1 | tee "$out" >&2
echo
echo "| scenario | records | lost | delivered | parked | daemon restarts |"
echo "|---|---|---|---|---|---|"
grep -o 'HOSTILE .*' "$out" | awk '{
    for (i = 2; i <= NF; i++) { split($i, p, "="); v[p[1]] = p[2] }
    printf "| %s ordinary records beside %s generated hostile ones | %s | %s | %s | %s | %s |\n", v["ordinary"], v["hostile"], v["records"], v["lost"], v["delivered"], v["parked"], v["restarts"]
  }'
