#!/usr/bin/env bash
# Runs the fault scenarios and the soak (tests/suite/faults.rs), the slowness scenarios
# (tests/suite/slowness.rs) and the hostile records (tests/suite/hostile.rs), one test at a time, and
# prints the README's tables: scenario, records, lost, duplicates (and how they are accounted
# for), lateness p99. FAULT_TESTS picks the test files (default "faults slowness hostile").
# Soak size: TIMEOUTD_SOAK_RECORDS (100000), TIMEOUTD_SOAK_SECONDS (180). A failing scenario
# leaves the rows of the others; the script then exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
scripts/ensure-rabbitmq.sh
[ -n "${TIMEOUTD_TEST_MONGODB_URI:-}" ] || scripts/install-test-mongodb.sh
out="$(mktemp)"
status=0
for t in ${FAULT_TESTS:-faults slowness hostile}; do
  cargo test --features failpoints --test suite "$t::" -- --include-ignored --nocapture --test-threads=1 2>&1 | tee -a "$out" >&2 || status=1
done
if grep -q 'FAULTS ' "$out"; then
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
fi
if grep -q 'HOSTILE ' "$out"; then
  echo
  echo "| scenario | records | lost | delivered | parked | left, unschedulable (named by the census) | daemon restarts |"
  echo "|---|---|---|---|---|---|---|"
  grep -o 'HOSTILE .*' "$out" | awk '{
      for (i = 2; i <= NF; i++) { split($i, p, "="); v[p[1]] = p[2] }
      printf "| %s ordinary records beside %s generated hostile ones | %s | %s | %s | %s | %s | %s |\n", v["ordinary"], v["hostile"], v["records"], v["lost"], v["delivered"], v["parked"], v["unschedulable"], v["restarts"]
    }'
fi
exit $status
