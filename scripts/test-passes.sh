#!/usr/bin/env bash
# make test's two passes, embedded and servers, at the same time.
#
# Each pass alone leaves a third of the machine idle (its tests wait on daemons, leases and kills), so
# the two together take about the time of the longer one rather than the sum (README, "Tests"). Each
# writes its whole output to var/test-logs/<pass>.log; while they run, a line every 30 s says how far
# each has come; at the end both outputs are printed, one after the other, and the exit status is a
# failure if either pass failed. TEST_WORKERS=0 (one process a pass) runs them one after the other, as
# before: without pytest-xdist the two would share var/.
set -u
cd "$(dirname "$0")/.."
MAKE_CMD=${MAKE:-make}
if [ "${TEST_WORKERS:-3}" = "0" ]; then
  "$MAKE_CMD" --no-print-directory test-embedded && "$MAKE_CMD" --no-print-directory test-servers
  exit $?
fi

logs=var/test-logs
mkdir -p "$logs"
start=$(date +%s)
"$MAKE_CMD" --no-print-directory test-embedded > "$logs/embedded.log" 2>&1 &
embedded=$!
"$MAKE_CMD" --no-print-directory test-servers > "$logs/servers.log" 2>&1 &
servers=$!
trap 'kill "$embedded" "$servers" 2>/dev/null; exit 130' INT TERM

progress() {  # the last "[ NN%]" pytest printed, or what the pass is doing before its first
  local shown
  shown=$(grep -o '\[ *[0-9]*%\]' "$logs/$1.log" 2>/dev/null | tail -n 1 | tr -d '[] ')
  echo "${shown:-starting}"
}

while kill -0 "$embedded" 2>/dev/null || kill -0 "$servers" 2>/dev/null; do
  for _ in $(seq 30); do
    sleep 1
    kill -0 "$embedded" 2>/dev/null || kill -0 "$servers" 2>/dev/null || break
  done
  echo "[$(( $(date +%s) - start ))s] embedded pass: $(progress embedded); servers pass: $(progress servers)"
done
wait "$embedded"; embedded_rc=$?
wait "$servers"; servers_rc=$?

echo "==================== embedded pass (exit $embedded_rc) ===================="
cat "$logs/embedded.log"
echo "==================== servers pass (exit $servers_rc) ===================="
cat "$logs/servers.log"
[ "$embedded_rc" -eq 0 ] && [ "$servers_rc" -eq 0 ]
