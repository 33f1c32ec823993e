"""The fleet overview page and the playground (both linked from the admin index), and a health check."""

from django.contrib import admin
from django.http import JsonResponse
from django.template.response import TemplateResponse

from fleet.selectors import fleet_overview as fleet_overview_data
from nodes.selectors import node_speech_models, node_vision_models


def fleet_overview(request):
    context = {**admin.site.each_context(request), "title": "Fleet", **fleet_overview_data()}
    return TemplateResponse(request, "fleet/overview.html", context)


def playground(request):
    """Chat with a served model; the page streams over /ws/v1/generate with the staff user's session. A speech
    model takes an audio file instead, sent to /v1/audio/transcriptions with the same session; a model some node reads
    images with (`vision`) takes an image attachment beside the message."""
    from fleet.links import registry

    models = registry().placement.models()
    context = {**admin.site.each_context(request), "title": "Playground", "models": models,
               "speech_models": node_speech_models(), "vision_models": node_vision_models()}
    return TemplateResponse(request, "fleet/playground.html", context)


def healthz(request):
    """Liveness for load balancers and tests: this head process, its connected nodes and the models served."""
    from fleet.links import registry

    reg = registry()
    return JsonResponse({"ok": True, "nodes": len(reg.links), "models": reg.placement.models()})
