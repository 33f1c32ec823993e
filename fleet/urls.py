"""HTTP routes: the admin (with the fleet page), the OpenAI-compatible /v1 API and the management /api."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from fleet import metrics, views
from nodes import views as node_views

admin.site.site_header = "Fleet administration"
admin.site.site_title = "Fleet"
admin.site.index_title = "Nodes, keys, conversations and generations"
# No app list down the left of every page (the index and the breadcrumbs lead there): the lists, the fleet page and
# a node's page get the window's width, and fit a 1,400 px one (tests/test_pages_browser.py).
admin.site.enable_nav_sidebar = False
# The head has no public site: `/` leads to the admin, and the admin's "View site" to the live fleet page.
admin.site.site_url = "/admin/fleet/"

# Under /v1/ and /api/, Django's own 404 and 500 pages answer in the API's error shape.
handler404 = "api.errors.not_found"
handler500 = "api.errors.server_error"

# The API's routes first: Django tries patterns in order, and each request keeps the list of those it tried (its
# ResolverMatch.tried) for as long as it runs. Tried first, a streaming /v1 request tries no other; the admin's
# routes cannot clash with /v1/ and /api/.
urlpatterns = [
    path("", include("api.urls")),
    path("admin/fleet/", admin.site.admin_view(views.fleet_overview), name="fleet-overview"),
    path("admin/playground/", admin.site.admin_view(views.playground), name="fleet-playground"),
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(pattern_name="admin:index"), name="home"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("models/blobs/<str:sha256>", node_views.model_blob, name="model-blob"),
]
