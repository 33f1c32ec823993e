"""The head freezes what it loaded before serving out of the garbage collector's full collections (fleet/heap.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

from django.test import override_settings

from fleet.heap import freeze_startup_heap


class Box:
    pass


PROBE = "import gc, fleet.asgi; print(gc.get_freeze_count())"


def _frozen_in_a_new_head_process(tmp_path, **env: str) -> int:
    """How many objects a fresh process has frozen once it has loaded the head's ASGI application."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FLEET_HOME": str(tmp_path), "FLEET_MDNS": "0",
                               "DJANGO_SETTINGS_MODULE": "fleet.settings", **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_the_head_application_freezes_what_it_loaded_and_the_setting_turns_it_off(tmp_path):
    assert _frozen_in_a_new_head_process(tmp_path) > 50_000  # Django, the apps and the modules
    assert _frozen_in_a_new_head_process(tmp_path, FLEET_GC_FREEZE="0") == 0


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
