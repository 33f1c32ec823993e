"""`/api/models/`: the model registry over the management API (staff only).

A file of any size is uploaded in parts, one request each (at most FLEET_MAX_BODY_BYTES): start an upload, PUT its
parts in order at their offsets, then create the model from it. The head never holds more than one part in memory,
and a client that lost its place asks for it (a part at the wrong offset is a 409 that names the right one).
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.response import Response

from api.views import IsStaff
from nodes import on_demand, registry
from nodes.models import Model, ModelAlias


class ModelSerializer(serializers.ModelSerializer):
    base = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True,
        help_text="For a LoRA adapter or a projector: the model it belongs to; null for a model.")

    class Meta:
        model = Model
        fields = ["id", "name", "kind", "base", "sha256", "size", "architecture", "quantization", "context_length",
                  "kv_bytes_per_token", "chat_template", "on_demand", "min_replicas", "max_replicas", "keep_alive_s",
                  "created_at", "updated_at"]
        read_only_fields = fields


class ModelOnDemandSerializer(serializers.Serializer):
    """What PATCH may change: whether the model loads on demand, its replicas' bounds and keep-alive."""

    on_demand = serializers.BooleanField(required=False, help_text="Loaded where there is room when a request names "
                                         "it and no node serves it; unloaded when idle.")
    min_replicas = serializers.IntegerField(required=False, min_value=0, help_text="Replicas kept however idle.")
    max_replicas = serializers.IntegerField(required=False, min_value=1,
                                            help_text="The most replicas loaded while its queue waits.")
    keep_alive_s = serializers.IntegerField(required=False, min_value=1,
                                            help_text="Seconds a replica may sit idle before it is unloaded.")


class ModelCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64, help_text="The model's name on the fleet (nodes pull it by this).")
    upload = serializers.CharField(help_text="The id of a finished upload (POST /api/models/uploads/).")
    base = serializers.CharField(max_length=64, required=False, default="", allow_blank=True,
                                 help_text="For a LoRA adapter or an image projector: the registry model it belongs "
                                           "to.")


class UploadSerializer(serializers.Serializer):
    upload = serializers.CharField(help_text="The upload's id.")
    offset = serializers.IntegerField(help_text="Bytes received so far: where the next part goes.")
    part_max_bytes = serializers.IntegerField(help_text="The most one part may hold (FLEET_MAX_BODY_BYTES).")


class PartParser(BaseParser):
    """A part's raw bytes: the view copies the stream to disk without reading it into a Python object."""

    media_type = "application/octet-stream"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream


def _upload_body(upload_id: str, offset: int) -> dict:
    return {"upload": upload_id, "offset": offset, "part_max_bytes": settings.FLEET_MAX_BODY_BYTES}


@extend_schema_view(list=extend_schema(summary="List the registry's models"),
                    retrieve=extend_schema(summary="A registry model"))
class ModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                   viewsets.GenericViewSet):
    """GGUF models on the head (staff only); every figure is read from the file's own metadata."""

    queryset = Model.objects.all()
    serializer_class = ModelSerializer
    permission_classes = [IsStaff]

    @extend_schema(request=ModelCreateSerializer, responses={201: ModelSerializer},
                   summary="Add the model in a finished upload")
    def create(self, request, *args, **kwargs):
        form = ModelCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            model = registry.model_upload_finish(upload_id=form.validated_data["upload"],
                                                 name=form.validated_data["name"],
                                                 base=form.validated_data.get("base", ""))
        except registry.RegistryError as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return Response(ModelSerializer(model).data, status=status.HTTP_201_CREATED)

    def get_object(self):
        # OPTIONS on an upload's URL asks its PUT for an object to check permissions on; the route has no pk (an
        # upload is not a model yet): no object, so DRF leaves the PUT out of the answer instead of failing.
        if self.lookup_field not in self.kwargs:
            raise NotFound("an upload is not a model")
        return super().get_object()

    @extend_schema(request=ModelOnDemandSerializer, responses={200: ModelSerializer},
                   summary="Set on demand, its replicas' bounds and keep-alive")
    def partial_update(self, request, *args, **kwargs):
        model = self.get_object()
        form = ModelOnDemandSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        unknown = sorted(set(request.data) - set(form.fields)) if isinstance(request.data, dict) else []
        if unknown:
            raise ValidationError({name: ["read-only: only on_demand, min_replicas, max_replicas and keep_alive_s "
                                          "can be changed"] for name in unknown})
        try:
            model = on_demand.model_on_demand_update(model=model, **form.validated_data)
        except on_demand.OnDemandError as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return Response(ModelSerializer(model).data)

    @extend_schema(summary="Delete (its file goes when no other name uses it)")
    def destroy(self, request, *args, **kwargs):
        registry.model_delete(model=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={201: UploadSerializer}, summary="Start an upload")
    @action(detail=False, methods=["post"], url_path="uploads")
    def upload_start(self, request):
        return Response(_upload_body(registry.model_upload_start(), 0), status=status.HTTP_201_CREATED)

    @extend_schema(request={"application/octet-stream": bytes}, responses={200: UploadSerializer},
                   parameters=[OpenApiParameter("offset", int, required=True,
                                                description="Where this part goes: the bytes received so far."),
                               OpenApiParameter("upload_id", str, OpenApiParameter.PATH,
                                                description="The upload's id, from POST /api/models/uploads/.")],
                   summary="Append a part")
    @action(detail=False, methods=["put"], url_path=r"uploads/(?P<upload_id>[^/.]+)", parser_classes=[PartParser])
    def upload_part(self, request, upload_id=None):
        try:
            offset = int(request.query_params.get("offset", ""))
        except ValueError:
            raise ValidationError({"offset": ["give the part's offset as a whole number (?offset=N)"]}) from None
        try:
            size = registry.model_upload_append(upload_id=upload_id, offset=offset, source=request.data)
        except registry.UploadUnknown as exc:
            raise NotFound(str(exc)) from None
        except registry.UploadOffset as exc:
            return Response({"detail": str(exc), **_upload_body(upload_id, exc.size)}, status=status.HTTP_409_CONFLICT)
        return Response(_upload_body(upload_id, size))


class ModelAliasSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelAlias
        fields = ["id", "name", "target", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate(self, attrs):
        name = attrs.get("name", getattr(self.instance, "name", "")).strip()
        target = attrs.get("target", getattr(self.instance, "target", "")).strip()
        if not name or not target or name == target:
            raise ValidationError("An alias needs a name and another model's name as its target.")
        return {**attrs, "name": name, "target": target}


@extend_schema_view(list=extend_schema(summary="List the model aliases"),
                    retrieve=extend_schema(summary="A model alias"),
                    create=extend_schema(summary="Map a name clients send to a served model"))
class ModelAliasViewSet(viewsets.ModelViewSet):
    """Names a client may send for a served model, in every API (staff only). /v1/models lists an alias while its
    target is served."""

    queryset = ModelAlias.objects.all()
    serializer_class = ModelAliasSerializer
    permission_classes = [IsStaff]
