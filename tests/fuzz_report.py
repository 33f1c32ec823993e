"""The fuzzers' request counts, printed in pytest's terminal summary so every CI log shows them (with or without -s).

A plugin: tests/test_fuzz_api.py loads it with `pytest_plugins`, and counts into COUNTS as it sends.
"""

from __future__ import annotations

from collections import Counter

MIN_REQUESTS = 2000
COUNTS: Counter[str] = Counter()
STATUSES: Counter[tuple[str, int]] = Counter()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    terminalreporter.section("fuzzing")
    for label, count in sorted(COUNTS.items()):
        statuses = ", ".join(f"{status}: {n}" for (name, status), n in sorted(STATUSES.items()) if name == label)
        terminalreporter.write_line(f"{label}: {count} generated requests ({statuses})")
    total = sum(COUNTS.values())
    terminalreporter.write_line(f"total: {total} generated requests (at least {MIN_REQUESTS} expected per run)")
