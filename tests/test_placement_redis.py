"""The placement and lifecycle tests again, on the placement state several head processes share through Redis."""

import os
import uuid

import pytest

import tests.test_placement as base
from tests.test_placement import *  # noqa: F403 - the same tests, collected here against Redis

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")


@pytest.fixture(autouse=True)
def redis_placement(monkeypatch):
    from fleet.placement_redis import RedisPlacementState

    made = []

    def factory(load_tokens: int | None = None, max_keys: int = 200_000):
        state = RedisPlacementState(os.environ["REDIS_URL"], prefix=f"fleet-rt-{uuid.uuid4().hex[:8]}:",
                                    load_tokens=load_tokens, max_keys=max_keys)
        made.append(state)
        return state

    monkeypatch.setattr(base, "PlacementState", factory)
    yield
    for state in made:
        state.clear()
