"""The head freezes what it loaded before serving out of the garbage collector's full collections (fleet/heap.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
from django.test import override_settings

from fleet.heap import DEFAULT_GC_THRESHOLDS, freeze_startup_heap, gc_thresholds


class Box:
    pass


PROBE = "import gc, fleet.asgi; print(gc.get_freeze_count(), *gc.get_threshold())"


def _new_head_process(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """A fresh process that loads the head's ASGI application and prints its frozen count and gc thresholds."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLEET_GC_")}, "FLEET_HOME": str(tmp_path),
           "FLEET_MDNS": "0", "DJANGO_SETTINGS_MODULE": "fleet.settings", **env}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)


def _frozen_and_thresholds(tmp_path, **env: str) -> tuple[int, tuple[int, ...]]:
    done = _new_head_process(tmp_path, **env)
    assert done.returncode == 0, done.stderr
    frozen, *thresholds = map(int, done.stdout.split()[-4:])
    return frozen, tuple(thresholds)


def test_the_head_application_freezes_what_it_loaded_and_the_setting_turns_it_off(tmp_path):
    assert _frozen_and_thresholds(tmp_path)[0] > 50_000  # Django, the apps and the modules
    assert _frozen_and_thresholds(tmp_path, FLEET_GC_FREEZE="0")[0] == 0


def test_the_head_keeps_pythons_thresholds_unless_the_setting_changes_them(tmp_path):
    assert gc_thresholds(DEFAULT_GC_THRESHOLDS) is None
    assert _frozen_and_thresholds(tmp_path)[1] == (700, 10, 10)  # Python's own
    assert _frozen_and_thresholds(tmp_path, FLEET_GC_THRESHOLDS="5000,3,10")[1] == (5000, 3, 10)
    assert _frozen_and_thresholds(tmp_path, FLEET_GC_THRESHOLDS=" 20000,5,10 ")[1] == (20000, 5, 10)


@pytest.mark.parametrize("value", ["5000,3", "a,b,c", "5000,0,10", "5000;3;10"])
def test_a_bad_threshold_setting_stops_the_head_with_one_clear_line(tmp_path, value):
    done = _new_head_process(tmp_path, FLEET_GC_THRESHOLDS=value)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"fleet: FLEET_GC_THRESHOLDS must be three whole numbers of at least 1, such as "
                                   f"5000,3,10 (or empty for Python's own 700,10,10), not {value!r}")


def test_frozen_objects_are_left_out_of_collections_and_still_freed_by_their_last_reference():
    gc.unfreeze()
    try:
        with override_settings(FLEET_GC_FREEZE=False):
            assert freeze_startup_heap() == 0
        cycle = Box()
        cycle.me = cycle
        collected = weakref.ref(cycle)
        del cycle  # garbage in a cycle: only a collection frees it
        tracked = Box()
        gone = weakref.ref(tracked)
        gc.disable()  # no collection by chance before the freeze's own
        assert freeze_startup_heap() > 0
        assert collected() is None  # collected first, not frozen for the life of the process
        assert not any(obj is tracked for obj in gc.get_objects())  # frozen: no collection scans it
        del tracked
        assert gone() is None  # freed by its last reference all the same
    finally:
        gc.enable()
        gc.unfreeze()
