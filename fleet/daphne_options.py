"""Daphne's options that the head's own limits decide: what one websocket message may hold.

Daphne caps a websocket message (and frame) at 1 MiB unless told otherwise, while a node link frame may hold
FLEET_LINK_MAX_FRAME_BYTES (4 MiB: a tokenizer part, an embedding batch's answer, a long prompt's Generate) and a
client stream frame FLEET_MAX_BODY_BYTES. Over daphne's cap autobahn closes the socket (1009), and on a node link
that ended every generation on it. So the head is started with daphne's own command-line options set a little
above both (the head's checks refuse a frame over its limit with a clear reason before daphne would close).
"""

from __future__ import annotations

import os

from django.conf import settings

MARGIN = 64 * 1024  # so a frame just over the head's limits gets the head's own refusal, not autobahn's close


def websocket_max_bytes() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")  # a bench or test starting heads reads them too
    return max(settings.FLEET_LINK_MAX_FRAME_BYTES, settings.FLEET_MAX_BODY_BYTES) + MARGIN


def daphne_limit_args() -> list[str]:
    """The daphne command-line options for these limits (daphne's --websocket-max-message-size/-frame-size)."""
    size = str(websocket_max_bytes())
    return ["--websocket-max-message-size", size, "--websocket-max-frame-size", size]
