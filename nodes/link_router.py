"""A node's messages on an open link, each to its handler by its type: one table, read in one place. A message the
link's stage does not take (a heartbeat before register, a second register, a pull after it) is a protocol error,
as is a type with no route. Bundles are the transport's (several frames in one), so no route takes one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nodes.link.messages import (
    Accepted,
    Bye,
    Check,
    Cut,
    Done,
    Error,
    Heartbeat,
    LinkError,
    Message,
    Models,
    ModelState,
    Preparing,
    Pull,
    Register,
    StateResult,
    TokenBatch,
    TokenizerFile,
)
from nodes.link_session import LinkSession, Stage

Handler = Callable[[Any], Awaitable[None]]
Taken = Callable[[Any], bool]


class FrameRouter:
    """The message types a node sends -> (handler, whether the session takes it now). Messages have no subclasses:
    the table is keyed by exact type."""

    def __init__(self, session: LinkSession) -> None:
        s, generations = session, session.generations

        def always(msg: Message) -> bool:
            return True

        def joined(msg: Message) -> bool:
            return s.stage is Stage.JOINED

        def joining(msg: Message) -> bool:
            return s.stage is not Stage.JOINED

        self.routes: dict[type[Message], tuple[Handler, Taken]] = {
            TokenBatch: (generations.on_frame, always),  # one for a generation not running here is refused there
            Accepted: (generations.on_frame, always),
            Done: (generations.on_frame, always),
            Error: (generations.on_frame, always),
            Heartbeat: (s.on_heartbeat, always),  # refused before register, with its own reason
            Models: (s.on_models, joined),
            TokenizerFile: (s.on_tokenizer_file, s.tokenizers.wants),  # only a file the head asked for
            ModelState: (s.on_model_state, joined),
            StateResult: (generations.on_result, always),
            Register: (s.on_register, joining),
            Check: (s.on_check, joining),
            Pull: (s.on_pull, joining),
            Preparing: (s.on_preparing, joining),
            Cut: (s.on_cut, joined),
            Bye: (s.on_bye, always),
        }

    async def route(self, msg: Message) -> None:
        handler, taken = self.routes.get(type(msg), (None, None))
        if handler is None or not taken(msg):
            raise LinkError(f"unexpected message {type(msg).__name__} from a node")
        await handler(msg)
