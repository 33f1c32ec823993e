"""Model aliases (nodes.models.ModelAlias) as every API resolves them: a table kept in process for a few seconds.

Resolving runs where a request is parsed, sometimes on the event loop (api.specs.aparse): there it never reads the
database; `aaliases` refreshes the table first, in a thread, when it is stale. A change made in this process is
seen at once (a signal drops the table); one made in another head process within ALIASES_TTL_S.
"""

from __future__ import annotations

import asyncio
import time

from asgiref.sync import sync_to_async

ALIASES_TTL_S = 5.0

_table: dict[str, str] = {}
_loaded_at: float | None = None


def _fresh() -> bool:
    return _loaded_at is not None and time.monotonic() - _loaded_at < ALIASES_TTL_S


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def aliases() -> dict[str, str]:
    """name -> target. On an event loop, the table as last loaded (aaliases loads it first); elsewhere, fresh."""
    global _table, _loaded_at
    if not _fresh() and not _on_loop():
        from nodes.models import ModelAlias

        _table = dict(ModelAlias.objects.values_list("name", "target"))
        _loaded_at = time.monotonic()
    return _table


async def aaliases() -> dict[str, str]:
    return _table if _fresh() else await sync_to_async(aliases)()


def alias_resolve(name: str) -> str:
    """The served model a client's `name` stands for (the name itself when it is no alias)."""
    return aliases().get(name, name)


def aliases_changed(**_kwargs) -> None:
    global _loaded_at
    _loaded_at = None
