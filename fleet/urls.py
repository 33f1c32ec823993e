"""HTTP routes: the admin (with the fleet page), the OpenAI-compatible /v1 API and the management /api."""

from django.contrib import admin
from django.urls import include, path

from fleet import views

admin.site.site_header = "Fleet administration"
admin.site.site_title = "Fleet"
admin.site.index_title = "Nodes, keys, conversations and generations"

urlpatterns = [
    path("admin/fleet/", admin.site.admin_view(views.fleet_overview), name="fleet-overview"),
    path("admin/playground/", admin.site.admin_view(views.playground), name="fleet-playground"),
    path("admin/", admin.site.urls),
    path("healthz", views.healthz, name="healthz"),
    path("", include("api.urls")),
]
