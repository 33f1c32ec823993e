"""Telling a node's link, in whichever head process holds it, to send the node its deployments again."""

from __future__ import annotations

from fleet.names import node_group


def tell_nodes(node_ids: list[str]) -> None:
    """Have each node's link consumer, in whichever head process holds it, send the node its deployments again."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    for node_id in node_ids if layer is not None else []:
        async_to_sync(layer.group_send)(node_group(node_id), {"type": "node.deploy"})
