"""Routes of the OpenAI-compatible /v1 API and the management /api."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from api import anthropic_messages, deployments, model_registry, openapi_v1, responses_api, v1, v1_batches, views

# No `.json` suffix routes: `?format=` does the same, and the actions (drain, revoke, messages) take no `format`.
router = DefaultRouter()
router.include_format_suffixes = False
router.register("nodes", views.NodeViewSet, basename="node")
router.register("fleet-tokens", views.FleetTokenViewSet, basename="fleet-token")
router.register("keys", views.ApiKeyViewSet, basename="api-key")
router.register("sessions", views.SessionViewSet, basename="session")
router.register("grammars", views.GrammarHandleViewSet, basename="grammar")
router.register("logit-biases", views.LogitBiasHandleViewSet, basename="logit-bias")
router.register("generations", views.GenerationViewSet, basename="generation")
router.register("models", model_registry.ModelViewSet, basename="model")
router.register("model-aliases", model_registry.ModelAliasViewSet, basename="model-alias")
router.register("deployments", deployments.DeploymentViewSet, basename="deployment")

v1_patterns = [
    # The generation routes first: a request keeps the patterns it tried for as long as it streams.
    path("chat/completions", v1.chat_completions, name="v1-chat-completions"),
    path("completions", v1.completions, name="v1-completions"),
    path("responses", responses_api.responses, name="v1-responses"),
    path("messages", anthropic_messages.messages, name="v1-messages"),
    path("messages/count_tokens", anthropic_messages.count_tokens, name="v1-messages-count-tokens"),
    path("responses/<str:response_id>", responses_api.response_detail, name="v1-response"),
    path("responses/<str:response_id>/input_items", responses_api.response_input_items,
         name="v1-response-input-items"),
    path("openapi.json", openapi_v1.openapi_v1, name="v1-openapi"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="v1-openapi"), name="v1-docs"),

    path("models", v1.models, name="v1-models"),
    path("models/<path:model>", v1.model_detail, name="v1-model"),
    path("embeddings", v1.embeddings, name="v1-embeddings"),
    path("audio/transcriptions", v1.audio_transcriptions, name="v1-audio-transcriptions"),
    path("files", v1_batches.files, name="v1-files"),
    path("files/<str:file_id>", v1_batches.file_detail, name="v1-file"),
    path("files/<str:file_id>/content", v1_batches.file_content, name="v1-file-content"),
    path("batches", v1_batches.batch_collection, name="v1-batches"),
    path("batches/<str:batch_id>", v1_batches.batch_detail, name="v1-batch"),
    path("batches/<str:batch_id>/cancel", v1_batches.batch_cancel, name="v1-batch-cancel"),
]

urlpatterns = [
    path("v1/", include(v1_patterns)),
    path("api/fleet/", views.FleetStatusView.as_view(), name="api-fleet"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/", include(router.urls)),
]
