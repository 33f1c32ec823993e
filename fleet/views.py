"""The fleet overview page (linked from the admin index) and a health check."""

from django.contrib import admin
from django.http import JsonResponse
from django.template.response import TemplateResponse

from fleet.selectors import fleet_overview as fleet_overview_data


def fleet_overview(request):
    context = {**admin.site.each_context(request), "title": "Fleet", **fleet_overview_data()}
    return TemplateResponse(request, "fleet/overview.html", context)


def healthz(request):
    """Liveness for load balancers and tests: this head process, its connected nodes and the models served."""
    from fleet.links import registry

    reg = registry()
    return JsonResponse({"ok": True, "nodes": len(reg.links), "models": reg.placement.models()})
