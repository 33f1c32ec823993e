"""The management API under /api/ (DRF): thin views over nodes, sessions and api services and selectors."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from django.db.models import Count
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from api import serializers as s
from api import services as key_services
from api.errors import OpenAIError
from api.generation import Run
from api.models import ApiKey
from api.quotas import quota_admit
from api.specs import chat_request
from api.sse import first_event, sse_response
from api.status import fleet_status
from fleet import tracing
from fleet.links import registry
from nodes import services as node_services
from nodes.models import FleetToken, Node
from sessions import selectors, services
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle


class IsStaff(permissions.IsAdminUser):
    message = "Only staff (operators) may do this."


def _caller_key(request) -> ApiKey | None:
    return request.auth if isinstance(request.auth, ApiKey) else None


# --- nodes ----------------------------------------------------------------------------------------------------


@extend_schema_view(list=extend_schema(summary="List nodes"), retrieve=extend_schema(summary="A node"))
class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes that joined the fleet (staff only: addresses and versions are the operator's business; /api/fleet/
    shows any key what is served). Operators drain (finish running work, take none), cordon or uncordon them."""

    queryset = Node.objects.all()
    serializer_class = s.NodeSerializer
    permission_classes = [IsStaff]

    def get_serializer_context(self):
        from nodes.selectors import node_beats

        live = node_beats(Node.objects.values_list("id", flat=True))
        return {**super().get_serializer_context(), "live": live, "connected": set(registry().links)}

    def _hold(self, hold: str) -> Response:
        node = node_services.node_set_hold(node=self.get_object(), hold=hold)
        return Response(self.get_serializer(node).data)

    @extend_schema(request=None, summary="Drain: running generations finish, no new ones")
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def drain(self, request, pk=None):
        return self._hold(Node.Hold.DRAIN)

    @extend_schema(request=None, summary="Cordon: take no new generations")
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def cordon(self, request, pk=None):
        return self._hold(Node.Hold.CORDON)

    @extend_schema(request=None, summary="Uncordon: take new generations again")
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def uncordon(self, request, pk=None):
        return self._hold(Node.Hold.NONE)


# --- credentials ----------------------------------------------------------------------------------------------


class FleetTokenViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                        mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Fleet tokens nodes join with (staff only). The secret is shown once, in the create response."""

    queryset = FleetToken.objects.order_by("-created_at")
    serializer_class = s.FleetTokenSerializer
    permission_classes = [IsStaff]

    def get_queryset(self):
        # A revoked token is gone from /api (the admin keeps its record); `revoke` may name one again (harmless).
        tokens = super().get_queryset()
        return tokens if self.action == "revoke" else tokens.filter(revoked_at__isnull=True)

    @extend_schema(responses={201: s.FleetTokenCreatedSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        token, secret = node_services.fleet_token_create(name=serializer.validated_data["name"])
        data = s.FleetTokenCreatedSerializer({**s.FleetTokenSerializer(token).data, "token": secret}).data
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(summary="Revoke (nodes holding it are refused at their next handshake)",
                   description="The token stops working and is gone from /api (GET answers 404); its record stays "
                               "in the admin, with `revoked_at` set. `POST .../revoke/` does the same and answers "
                               "with the revoked token.")
    def destroy(self, request, *args, **kwargs):
        node_services.fleet_token_revoke(token=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses=s.FleetTokenSerializer, summary="Revoke, returning the token")
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        token = self.get_object()
        node_services.fleet_token_revoke(token=token)
        token.refresh_from_db()
        return Response(self.get_serializer(token).data)


class ApiKeyViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Your own API keys (staff: everyone's). The key is shown once, in the create response; DELETE revokes it.
    Quotas are set by staff in the admin; here they are read-only. `priority`, `weight` and `max_waiting` (the key's
    share of a full fleet) are set at creation or in the admin. Only staff create keys: quotas are per key, so a
    key that could mint another (at the defaults, or even at its own limits) would multiply what staff allowed it."""

    serializer_class = s.ApiKeySerializer
    queryset = ApiKey.objects.none()  # for the schema; get_queryset narrows to the caller's keys

    def get_queryset(self):
        # A revoked key is gone from /api (the admin keeps its record, and its generations keep naming it).
        keys = ApiKey.objects.select_related("owner").filter(revoked_at__isnull=True).order_by("-created_at")
        return keys if self.request.user.is_staff else keys.filter(owner=self.request.user)

    def get_permissions(self):
        return [IsStaff()] if self.action == "create" else super().get_permissions()

    @extend_schema(responses={201: s.ApiKeyCreatedSerializer}, description="Staff only.")
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        share = {f: serializer.validated_data[f] for f in ApiKey.SHARE_FIELDS if f in serializer.validated_data}
        row, key = key_services.api_key_create(owner=request.user, name=serializer.validated_data["name"],
                                               quotas=share)
        data = {**s.ApiKeySerializer(row).data, "key": key}  # the created-key shape: the row's fields and the key
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(summary="Revoke the key",
                   description="The key stops working at once and is gone from /api (GET answers 404); its record "
                               "stays in the admin, with `revoked_at` set, and its generations keep naming it.")
    def destroy(self, request, *args, **kwargs):
        key_services.api_key_revoke(key=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- sessions -------------------------------------------------------------------------------------------------


@extend_schema_view(destroy=extend_schema(description="Deletes the session and its messages for good (a GET is then "
                                                      "a 404); the generation records that ran in it stay."))
class SessionViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Server-side conversations. Continue one with POST messages/ here, or `session` on /v1/chat/completions."""

    queryset = InferenceSession.objects.none()  # for the schema; get_queryset narrows to the caller's

    def get_queryset(self):
        queryset = selectors.session_list(user=self.request.user).annotate(message_count=Count("messages"))
        if self.action == "retrieve":
            queryset = queryset.prefetch_related("messages")
        return queryset

    def get_serializer_class(self):
        return s.SessionDetailSerializer if self.action == "retrieve" else s.SessionSerializer

    def perform_create(self, serializer):
        data = dict(serializer.validated_data)
        serializer.instance = services.session_create(owner=self.request.user, api_key=_caller_key(self.request),
                                                      **data)

    def perform_destroy(self, instance):
        services.session_delete(session=instance)

    @extend_schema(methods=["GET"], responses=s.MessageSerializer(many=True), summary="The session's messages")
    @extend_schema(methods=["POST"], request=s.ContinueSerializer, responses={200: s.ContinueResultSerializer},
                   summary="Continue the conversation (SSE chunks with stream: true)")
    @action(detail=True, methods=["get", "post"])
    def messages(self, request, pk=None):
        session = self.get_object()
        if request.method == "GET":
            page = self.paginate_queryset(selectors.message_list(session=session))
            return self.get_paginated_response(s.MessageSerializer(page, many=True).data)
        check = s.ContinueSerializer(data=request.data)
        check.is_valid(raise_exception=True)
        return self._continue(session, dict(request.data))

    def _continue(self, session, data: dict):
        messages = data.pop("messages", None) or [{"role": "user", "content": data.pop("content")}]
        data.pop("content", None)
        body = {**data, "model": data.get("model") or session.model, "messages": messages, "session": str(session.id)}
        key = _caller_key(self.request)
        try:
            gen = chat_request(body, api_key=key, user=self.request.user)
            # The throttle counted the request; a generation also checks the key's tokens and takes a stream slot.
            ticket = async_to_sync(quota_admit)(key, request=False, tokens=True, stream=True) if key else None
            run = Run(gen, ticket, tracing.request_begin(self.request.headers, self.request.path))
            if gen.stream:
                return sse_response(run, async_to_sync(first_event)(run))
            async_to_sync(_drain)(run)
        except OpenAIError as exc:
            return Response({"detail": exc.message, "code": exc.code, "param": exc.param}, status=exc.status,
                            headers=exc.headers)
        result = {"session": session.id, "generation": gen.gen_id, "message": run.answer_message(),
                  "finish_reason": run.finish_reason(), "usage": run.usage(), "node": run.node}
        return Response(s.ContinueResultSerializer(result).data)


async def _drain(run: Run) -> None:
    async for _ in run.events():
        pass


# --- handles --------------------------------------------------------------------------------------------------


FREED = ("The handle is freed and gone from /api (GET answers 404); its record stays in the admin, with `freed_at` "
         "set, and a generation naming it gets a 400 saying when it was freed.")


class _HandleViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     mixins.DestroyModelMixin, viewsets.GenericViewSet):
    def destroy(self, request, *args, **kwargs):
        self.free(self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema_view(destroy=extend_schema(summary="Free the handle (generations naming it get a 400)",
                                          description=FREED))
class GrammarHandleViewSet(_HandleViewSet):
    """Grammars kept on the head (GBNF, or a JSON schema); name one by id in `grammar` on /v1."""

    serializer_class = s.GrammarHandleSerializer
    queryset = GrammarHandle.objects.none()

    def get_queryset(self):
        return selectors.grammar_handle_list(user=self.request.user).filter(freed_at__isnull=True)

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = services.grammar_handle_create(
            kind=data["kind"], source=data["source"], name=data.get("name", ""), owner=self.request.user,
            api_key=_caller_key(self.request))

    def free(self, handle):
        services.grammar_handle_free(handle=handle)


@extend_schema_view(destroy=extend_schema(summary="Free the handle (generations naming it get a 400)",
                                          description=FREED))
class LogitBiasHandleViewSet(_HandleViewSet):
    """Token-id biases kept on the head; name one by id in `logit_bias_handle` on /v1."""

    serializer_class = s.LogitBiasHandleSerializer
    queryset = LogitBiasHandle.objects.none()

    def get_queryset(self):
        return selectors.logit_bias_handle_list(user=self.request.user).filter(freed_at__isnull=True)

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = services.logit_bias_handle_create(
            bias=data["bias"], name=data.get("name", ""), owner=self.request.user, api_key=_caller_key(self.request))

    def free(self, handle):
        services.logit_bias_handle_free(handle=handle)


# --- generations and the fleet --------------------------------------------------------------------------------

GENERATION_FILTERS = [
    OpenApiParameter(name, OpenApiTypes.STR, description=text)
    for name, text in (("model", "model name"), ("node", "node id or identity"), ("status", "done, failed, "
                       "cancelled or expired"), ("session", "session id"),
                      ("kind", "chat, completion, responses, messages or transcription"))
]


@extend_schema_view(list=extend_schema(parameters=GENERATION_FILTERS))
class GenerationViewSet(viewsets.ReadOnlyModelViewSet):
    """Generation records: one per generation, written when it ended."""

    serializer_class = s.GenerationSerializer
    queryset = Generation.objects.none()

    def get_queryset(self):
        q = self.request.query_params
        filters = {name: q.get(name) for name in ("model", "node", "status", "session", "kind")}
        bad = {name: "must not contain NUL characters" for name, value in filters.items() if value and "\x00" in value}
        if bad:  # PostgreSQL refuses NUL in a string; a 400, not a 500
            raise ValidationError(bad)
        return selectors.generation_list(user=self.request.user, **filters)


class FleetStatusView(APIView):
    """Models served, nodes with their lanes, and how many generations wait for a lane."""

    @extend_schema(responses=s.FleetStatusSerializer)
    def get(self, request):
        return Response(s.FleetStatusSerializer(fleet_status()).data)
