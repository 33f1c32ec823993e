#!/usr/bin/env bash
# `make test` with no TIERS: every tier once, as two pytest processes side by side. The in-process half (the
# Django-free and in-process tiers) keeps a core busy; the other half (real processes and the browser) mostly waits
# on heads, nodes and Chromium starting, so alone the suite left half the machine idle. Each half has a FLEET_HOME of
# its own (settings keep a secret key and Celery's folders there), its own pytest cache folder and its own list of
# slowest tests; the real-process half prints as it runs, the in-process half's output follows it.
# Usage: tests/run_tiers.sh PYTHON [pytest args...]
set -u
python="$1"; shift
home="${FLEET_HOME:-$(mktemp -d)}"
log="$(mktemp)"

FLEET_HOME="$home/tests-in-process" "$python" -m pytest --durations=25 -o cache_dir=.pytest_cache/in_process \
  -m "django_free or in_process" "$@" >"$log" 2>&1 &
in_process=$!
real_rc=0
FLEET_HOME="$home/tests-real-procs" "$python" -m pytest --durations=25 -m "not (django_free or in_process)" "$@" \
  || real_rc=$?
in_process_rc=0
wait "$in_process" || in_process_rc=$?

echo "===== the Django-free and in-process tiers (run side by side with the above) ====="
cat "$log"
rm -f "$log"
[ "$real_rc" -eq 0 ] || echo "make test: the real-process and browser tiers failed (pytest exit $real_rc)" >&2
[ "$in_process_rc" -eq 0 ] || echo "make test: the Django-free and in-process tiers failed (pytest exit $in_process_rc)" >&2
[ "$real_rc" -eq 0 ] && [ "$in_process_rc" -eq 0 ]
