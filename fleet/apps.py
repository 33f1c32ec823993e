"""The fleet app: the ASGI request path's signal receivers."""

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"

    def ready(self) -> None:
        wire_request_started()


def wire_request_started() -> None:
    """Django closes stale database connections and clears the query log when a request starts. Under ASGI a
    request's synchronous work runs on a thread of its own (its connection is closed when the request finishes), so
    at the start there is nothing to close or clear, and the two receivers only cost a hop to that thread before the
    view runs. They stay for the WSGI handler, whose threads serve request after request. (Django's test client
    connects `close_old_connections` for every sender again after each request it makes: tests call this again.)"""
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.signals import request_started
    from django.db import close_old_connections, reset_queries

    for receiver in (close_old_connections, reset_queries):
        request_started.disconnect(receiver)
        request_started.connect(receiver, sender=WSGIHandler)
