"""The head's HTTP requests skip Twisted's form parsing: daphne hands Django the body as received, and Django parses
what it needs.

Twisted's `Request.requestReceived` (daphne's server) parses the Content-Type of every POST with a body through the
standard library's email parser, and a form's body (URL-encoded or multipart) into `request.args`, on the event
loop, before daphne sees the request. Daphne never reads `args`. So every POST paid for a parse nobody used, and a
multipart upload (an audio file to /v1/audio/transcriptions) was read whole into memory and parsed on the event
loop, every stream waiting, before Django parsed it again. Twisted's own switch
for it (`parsePOSTFormSubmission`, an argument of its Request) is off for daphne's requests here.
"""

from __future__ import annotations

import inspect

_installed: dict[str, object] = {}


def skip_form_parsing() -> bool:
    """Make daphne's requests skip Twisted's form parsing (once per process); False where this Twisted's Request
    has no such switch, which leaves it as it is."""
    from daphne.http_protocol import WebRequest
    from twisted.web import http

    if "init" in _installed:
        return True
    if "parsePOSTFormSubmission" not in inspect.signature(http.Request.__init__).parameters:
        return False
    original = _installed["init"] = WebRequest.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parsePOSTFormSubmission", False)
        original(self, *args, **kwargs)

    WebRequest.__init__ = __init__
    return True
