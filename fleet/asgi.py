"""ASGI entry point: HTTP behind the body-size limit (the generation endpoints by api.streaming_app, the rest by
Django), the node link (/ws/node/) and client streams (/ws/v1/generate)."""

import os

import django
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application

from fleet import tracing  # noqa: E402

tracing.setup("fleet-head")  # OTEL_EXPORTER_OTLP_ENDPOINT set: spans exported; else nothing

from django.core.handlers.asgi import ASGIHandler  # noqa: E402

django_app = ASGIHandler()  # Django's own handler (what get_asgi_application returns, django being set up above)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from api.draining import refuse_while_draining  # noqa: E402
from api.limits import body_limit  # noqa: E402
from api.sse import unfinished_streams_abandoned  # noqa: E402
from api.streaming_app import generations_first  # noqa: E402
from fleet.discovery import announce_served_head  # noqa: E402
from fleet.heap import freeze_startup_heap  # noqa: E402
from fleet.links import registry  # noqa: E402
from fleet.routing import websocket_urlpatterns  # noqa: E402
from fleet.shutdown import install_drain_on_signals  # noqa: E402

announce_served_head()  # with FLEET_ANNOUNCE set, nodes started with no head address find this one
registry().heads.start()  # with Redis: this process joins the live head processes, so every node links to it too

# SIGTERM/SIGINT under daphne: no new work, the running generations finish or end with an error event, every
# record written; then the server stops as it always did
install_drain_on_signals(lambda: registry().shutdown, settings.FLEET_SHUTDOWN_GRACE_S)

application = refuse_while_draining(ProtocolTypeRouter({
    "http": body_limit(generations_first(unfinished_streams_abandoned(django_app))),
    "websocket": URLRouter(websocket_urlpatterns),
}), lambda: registry().shutdown)

freeze_startup_heap()  # the head as loaded, left out of the full collections that stop the event loop
