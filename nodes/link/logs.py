"""Log lines as text or as JSON (FLEET_LOG_FORMAT=json), on the head and on a node, with the generation they are about.

A line about a generation carries its id as `gen_id`: given with `extra={"gen_id": ...}`, or taken from
`current_gen_id`, which the head sets while it serves a generation, so a line logged anywhere under it (placement,
quotas, the record) carries the id without it being passed along. While tracing is on (nodes.link.trace), a line
also carries `trace_id` and `span_id`: those of its generation's span, else of the current span. Shared by the
head's settings and a node, so it imports nothing from Django.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from nodes.link import trace

FORMATS = ("plain", "json")
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"

current_gen_id: ContextVar[str | None] = ContextVar("fleet_gen_id", default=None)


def log_format(value: str | None) -> str:
    """FLEET_LOG_FORMAT checked: "plain" (the default) or "json"."""
    chosen = (value or "plain").strip().lower()
    if chosen not in FORMATS:
        raise ValueError(f"FLEET_LOG_FORMAT is {value!r}; set it to plain or json")
    return chosen


class generation_context:  # lower case: used as the function it was, `with generation_context(gen_id):`
    """Lines logged inside (and in tasks and threads started inside) carry this generation's id.

    A class rather than a `contextlib.contextmanager`: the head enters one for every event of every stream, and a
    generator-based one cost about three times as much (a generator, its frame and two resumptions each time)."""

    __slots__ = ("gen_id", "token")

    def __init__(self, gen_id: str) -> None:
        self.gen_id = gen_id

    def __enter__(self) -> None:
        self.token = current_gen_id.set(self.gen_id)

    def __exit__(self, *exc: object) -> None:
        current_gen_id.reset(self.token)


class GenIdFilter(logging.Filter):
    """Puts the generation being served on a record that was not given one with `extra`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "gen_id", None) is None and (gen_id := current_gen_id.get()) is not None:
            record.gen_id = gen_id
        if trace.ENABLED and getattr(record, "trace_id", None) is None:
            # the generation's span on this side (or the current one, in a Celery task): the line sits in its trace
            trace_id, span_id = trace.log_ids(getattr(record, "gen_id", None))
            if trace_id:
                record.trace_id, record.span_id = trace_id, span_id
        return True


class AnsweredStatusFilter(logging.Filter):
    """Django logs every 5xx response at ERROR; a 502/503/504 is an answer Fleet chose (a deadline passed, no node
    could serve, a node was lost) and says so to its client: a WARNING, so ERROR keeps meaning a fault here."""

    ANSWERED = frozenset({502, 503, 504})

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", None) in self.ANSWERED and record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class JsonFormatter(_LibraryJsonFormatter):
    """One JSON object a line: time, level, logger, message, and every `extra` field (gen_id among them)."""

    def __init__(self) -> None:
        super().__init__("{asctime}{levelname}{name}{message}", style="{",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


def handler(fmt: str) -> logging.Handler:
    """A stderr handler in the given format, with the generation filter."""
    out = logging.StreamHandler()
    out.addFilter(GenIdFilter())
    out.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN))
    return out


def configure(fmt: str, level: int = logging.INFO) -> None:
    """A node's logging (the root logger), in `fmt`, unless something configured it already."""
    logging.basicConfig(level=level, handlers=[handler(fmt)])
