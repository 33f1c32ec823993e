"""Attacks on a real head (daphne) (issue 41): what one client sends must not reach past its own request."""

import asyncio
import json

import pytest
import websockets

pytestmark = pytest.mark.slow


def test_a_client_frame_over_a_mebibyte_is_answered_not_cut_off(live_head):
    """Daphne closed any websocket message over 1 MiB (1009) though the docs allow FLEET_MAX_BODY_BYTES (4 MiB),
    and a node link's frames may be 4 MiB (FLEET_LINK_MAX_FRAME_BYTES): the head now starts daphne with its own
    limits (fleet/daphne_options.py), so such a frame gets the head's answer."""
    async def run():
        url = live_head.url.replace("http://", "ws://") + "/ws/v1/generate"
        async with websockets.connect(url, max_size=None,
                                      additional_headers={"Authorization": f"Bearer {live_head.api_key}"}) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "big", "model": "no-such-model", "max_tokens": 1,
                                      "prompt": "Hello" + " " * (2 * 1024 * 1024)}))
            return json.loads(await asyncio.wait_for(ws.recv(), 60))

    frame = asyncio.run(run())
    assert frame["id"] == "big" and frame["type"] == "error", frame
