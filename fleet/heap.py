"""The head process's garbage collector: what the head loads before it serves is frozen out of full collections.

Python's full collection (generation 2) stops the event loop while it scans every object the collector tracks,
and no stream gets its next token meanwhile: under many streams, the largest part of the added chunk gap. Over half
of what it scans in a serving head is Django, the apps and the modules loaded at startup. What is loaded before the
head serves lives as long as the process, so scanning it never frees anything; frozen (`gc.freeze`), it is left out
of every collection, which about halves what a full collection scans (docs/benchmarks.md, *Scale*).

Frozen objects are still freed when their last reference goes; only a reference cycle among them would never be
collected, and the collection just before the freeze clears the cycles startup left behind. `FLEET_GC_FREEZE=0`
turns it off.
"""

from __future__ import annotations

import gc

DEFAULT_GC_THRESHOLDS = ""  # Python's own; 5000,3,10 held 5x the memory in a 1 GiB upload's request bodies (cycles)


def gc_thresholds(value: str) -> tuple[int, int, int] | None:
    """FLEET_GC_THRESHOLDS as gc.set_threshold takes it: three whole numbers "a,b,c", or None (empty) for Python's
    own. ValueError, with what to write instead, for anything else."""
    value = value.strip()
    if not value:
        return None
    try:
        numbers = tuple(int(part) for part in value.split(","))
    except ValueError:
        numbers = ()
    if len(numbers) != 3 or min(numbers) < 1:
        raise ValueError(f"FLEET_GC_THRESHOLDS must be three whole numbers of at least 1, such as 5000,3,10 (or "
                         f"empty for Python's own 700,10,10), not {value!r}")
    return numbers  # type: ignore[return-value]


def freeze_startup_heap() -> int:
    """Set the collector's thresholds (FLEET_GC_THRESHOLDS), collect once, then freeze what is left (when
    FLEET_GC_FREEZE is on); how many objects are frozen now."""
    from django.conf import settings

    if settings.FLEET_GC_THRESHOLDS:
        gc.set_threshold(*settings.FLEET_GC_THRESHOLDS)
    if settings.FLEET_GC_FREEZE:
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
