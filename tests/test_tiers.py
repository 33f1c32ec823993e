"""The suite's tiers (tests/conftest.py): every test file has exactly one, and CI's backend pass really runs on the
backend it names."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.conftest import BACKEND_FREE, TIERS, file_tier

pytestmark = pytest.mark.django_db
HERE = Path(__file__).parent


def test_no_file_has_two_tiers_and_every_named_file_exists():
    """A file named nowhere is not an error here (it runs in every pass, and the run ends with a red line naming it
    and the markers to choose from): a branch that adds a test file merges without a conflict in TIERS."""
    files = {path.name for path in HERE.glob("test_*.py")}
    named = Counter(name for names in TIERS.values() for name in names)
    assert [name for name, count in named.items() if count > 1] == []
    assert sorted(set(named) - files) == [], "TIERS names files that are gone"
    assert files >= BACKEND_FREE


def test_an_untiered_file_runs_in_every_pass_and_is_named_at_the_end(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems, pytest_terminal_summary")
    pytester.makeini("[pytest]\nmarkers =\n  django_free\n  in_process\n  real_procs\n  browser\n  backend\n  slow")
    pytester.makepyfile(test_new="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-m", "backend and real_procs", "-p", "no:django")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*tests/test_new.py has no tier*TIERS in tests/conftest.py*"])


def test_a_test_carries_its_files_tier_and_the_backend_marker(request):
    assert file_tier("test_tiers.py") == "in_process"
    assert request.node.get_closest_marker("in_process") and request.node.get_closest_marker("backend")


@pytest.mark.slow
def test_a_slow_test_of_an_in_process_file_is_a_real_process_one(request):
    assert request.node.get_closest_marker("real_procs") and not request.node.get_closest_marker("in_process")


def test_the_backend_pass_runs_on_the_services_it_names():
    """CI's second pass sets DATABASE_URL and REDIS_URL: the tests then really run on PostgreSQL and Redis."""
    assert connection.vendor == ("postgresql" if os.environ.get("DATABASE_URL") else "sqlite")
    layer = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    assert ("redis" in layer.lower()) == bool(os.environ.get("REDIS_URL"))
