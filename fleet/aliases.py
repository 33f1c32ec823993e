"""Model aliases (nodes.models.ModelAlias) as every API resolves them: a table kept in process for a few seconds.

Resolving runs where a request is parsed, sometimes on the event loop (api.specs.aparse): there it never reads the
database; `aaliases` refreshes the table first, in a thread, when it is stale. A change made in this process is
seen at once (a signal drops the table: nodes.apps); one made in another head process within ALIASES_TTL_S.
"""

from __future__ import annotations

import asyncio
import time

from asgiref.sync import sync_to_async

ALIASES_TTL_S = 5.0


class AliasTable:
    """name -> target, as last loaded; one per head process (on the registry)."""

    def __init__(self) -> None:
        self._table: dict[str, str] = {}
        self._loaded_at: float | None = None

    def _fresh(self) -> bool:
        return self._loaded_at is not None and time.monotonic() - self._loaded_at < ALIASES_TTL_S

    def table(self) -> dict[str, str]:
        """On an event loop, the table as last loaded (`atable` loads it first); elsewhere, fresh."""
        if not self._fresh() and not _on_loop():
            from nodes.models import ModelAlias

            self._table = dict(ModelAlias.objects.values_list("name", "target"))
            self._loaded_at = time.monotonic()
        return self._table

    async def atable(self) -> dict[str, str]:
        return self._table if self._fresh() else await sync_to_async(self.table)()

    def resolve(self, name: str) -> str:
        """The served model a client's `name` stands for (the name itself when it is no alias)."""
        return self.table().get(name, name)

    def changed(self) -> None:
        self._loaded_at = None


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
