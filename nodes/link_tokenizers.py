"""A linked node's tokenizers on the head: the fingerprint of each model it serves (placement keys its prompts with
them), and the files the head asked for at register, taken part by part; the node is placeable once every one is
in (nodes.tokenizers keeps them)."""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async

from fleet.links import registry
from nodes import tokenizers
from nodes.link.messages import LinkError, Models, TokenizerFile

log = logging.getLogger("fleet")


class LinkTokenizers:
    """One link's tokenizers: `by_model` (the names it serves under -> fingerprints) and `due` (fingerprints asked
    for at register -> the parts so far)."""

    def __init__(self) -> None:
        self.by_model: dict[str, str] = {}
        self.due: dict[str, list[bytes]] = {}

    async def joined(self, by_model: dict[str, str]) -> list[str]:
        """The node registered with these: the fingerprints the head lacks, which it asks the node for."""
        self.by_model = by_model
        wanted = await asyncio.to_thread(lambda: sorted({fp for fp in by_model.values()
                                                         if not tokenizers.tokenizer_known(fp)}))
        self.due = {fp: [] for fp in wanted}
        return wanted

    def wants(self, msg: TokenizerFile) -> bool:
        return msg.fingerprint in self.due

    async def on_file(self, msg: TokenizerFile, identity: str) -> bool:
        """A part of a file the head asked for; the last one is checked and kept. True once every asked-for file is
        in (the node may take generations)."""
        parts = self.due[msg.fingerprint]
        if msg.part != len(parts) or not 0 < msg.parts <= 64 or msg.part >= msg.parts:
            raise LinkError(f"tokenizer_file: part {msg.part} of {msg.parts} out of order")
        parts.append(msg.data)
        if len(parts) < msg.parts:
            return False
        try:
            await asyncio.to_thread(tokenizers.tokenizer_receive, msg.fingerprint, b"".join(parts))
        except tokenizers.TokenizerRefused as exc:
            raise LinkError(f"tokenizer_file: {exc}") from None
        del self.due[msg.fingerprint]
        log.info("fleet node %r sent tokenizer %s", identity, msg.fingerprint[:12])
        return not self.due

    async def on_models(self, node_id: str, msg: Models) -> None:
        """A node that loaded a deployed model: the registry's tokenizer keys its prompts (its file is the
        registry's own)."""
        names = [m["name"] for m in msg.models if isinstance(m, dict) and isinstance(m.get("name"), str)]
        added = [name for name in names if name not in self.by_model]
        if added:
            found = await database_sync_to_async(lambda: {n: tokenizers.registry_fingerprint(n) for n in added})()
            self.by_model.update({name: fp for name, fp in found.items() if fp})
            await registry().aplacement.node_tokenizers(node_id, dict(self.by_model))
