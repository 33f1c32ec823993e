"""`/api/deployments/`: put a registry model on nodes chosen by name or label (staff only), and see where each
node-model pair stands (pulling 43%, loading, serving, draining, failed and why)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from api.views import IsStaff
from nodes import deployments
from nodes.models import Deployment, Model, NodeModel


class NodeModelSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.identity", read_only=True)
    node_state = serializers.CharField(source="node.state", read_only=True)
    summary = serializers.CharField(source="describe", read_only=True, help_text="e.g. pulling 43%, failed: why")

    class Meta:
        model = NodeModel
        fields = ["node", "node_state", "state", "progress", "detail", "summary", "updated_at"]
        read_only_fields = fields


class ModelName(serializers.SlugRelatedField):
    """A registry model by its name; a name with a NUL character is refused before the lookup (PostgreSQL cannot
    even compare one: the query would fail, a 500)."""

    def to_internal_value(self, data):
        if isinstance(data, str) and "\x00" in data:
            raise ValidationError("A model name cannot contain a NUL character: send a name as /api/models/ lists it.")
        return super().to_internal_value(data)


class DeploymentSerializer(serializers.ModelSerializer):
    model = ModelName(slug_field="name", queryset=Model.objects.all(),
                      help_text="A registry model's name (/api/models/).")
    nodes = serializers.ListField(child=serializers.CharField(max_length=200), required=False, default=list,
                                  help_text="Node identities to put it on.")
    labels = serializers.DictField(child=serializers.CharField(max_length=200), required=False, default=dict,
                                   help_text="Also every node with all these labels (node_join --label KEY=VALUE).")
    states = serializers.SerializerMethodField(help_text="Each node-model pair, as the nodes last reported it.")

    class Meta:
        model = Deployment
        fields = ["id", "model", "nodes", "labels", "lanes", "context", "states", "created_at", "updated_at"]
        read_only_fields = ["id", "states", "created_at", "updated_at"]

    @extend_schema_field(NodeModelSerializer(many=True))
    def get_states(self, deployment: Deployment) -> list[dict]:
        return NodeModelSerializer(deployments.deployment_states(deployment=deployment), many=True).data


@extend_schema_view(list=extend_schema(summary="List deployments"), retrieve=extend_schema(summary="A deployment"),
                    create=extend_schema(summary="Put a model on nodes"),
                    update=extend_schema(summary="Change a deployment"),
                    partial_update=extend_schema(summary="Change part of a deployment"),
                    destroy=extend_schema(summary="Take the model off its nodes (they drain it)"))
class DeploymentViewSet(viewsets.ModelViewSet):
    """Registry models on nodes (staff only). The head tells each matching node over its link to load or unload."""

    queryset = Deployment.objects.select_related("model")
    serializer_class = DeploymentSerializer
    permission_classes = [IsStaff]

    def perform_create(self, serializer):
        serializer.instance = self._service(deployments.deployment_create, **serializer.validated_data)

    def perform_update(self, serializer):
        serializer.instance = self._service(deployments.deployment_update, deployment=serializer.instance,
                                            **serializer.validated_data)

    def destroy(self, request, *args, **kwargs):
        deployments.deployment_delete(deployment=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @staticmethod
    def _service(service, **values):
        try:
            return service(**values)
        except deployments.DeploymentError as exc:
            raise ValidationError({"detail": str(exc)}) from None
