"""Serializers of the management API: they validate and shape; services do the writing."""

from __future__ import annotations

import contextlib
import dataclasses
import json

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from api.models import ApiKey
from api.quotas import limits_for
from nodes.models import FleetToken, Node
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message
from sessions.services import nul_problem


class NodeSerializer(serializers.ModelSerializer):
    live = serializers.SerializerMethodField(help_text="The last heartbeat (lanes busy, tokens/s), if recent.")
    lanes = serializers.SerializerMethodField(
        help_text="Lanes of all its engines (its own model's and every deployed or on-demand one's), as its last "
                  "heartbeat said, else as it joined; null for a node serving several models that has not beaten yet.")
    lanes_busy = serializers.SerializerMethodField(help_text="Lanes busy, as its last heartbeat said (null: none).")
    tokens_per_s = serializers.SerializerMethodField(help_text="Tokens a second it generated lately (null: no "
                                                               "heartbeat).")
    models = serializers.SerializerMethodField(
        help_text="Each model it serves with its own engine's lanes, lanes busy, KV used and total, tokens/s and the "
                  "context window its lanes run with (a LoRA adapter or speech model counts under its engine's model: "
                  "zero lanes). The live page, the node's page and /metrics show the same figures.")
    connected = serializers.SerializerMethodField(help_text="Whether this head process holds the node's link.")
    device = serializers.SerializerMethodField(
        help_text="What its engines run on: backend (cpu, cuda, rocm, vulkan, metal; unknown for a node that does not "
                  "say), devices with memory total and free in bytes (from the last heartbeat, else as registered), "
                  "layers offloaded of layers_total, the host's GPUs, cpu_fallback (on the CPU beside a GPU) and the "
                  "line the pages show.")

    class Meta:
        model = Node
        fields = ["id", "identity", "state", "hold", "models_served", "lanes", "lanes_busy", "tokens_per_s", "models",
                  "context_window", "labels", "address",
                  "version", "engine", "device", "capabilities", "replicas", "joined_at", "last_seen_at", "created_at",
                  "updated_at", "live", "connected"]
        read_only_fields = fields

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_live(self, node: Node) -> dict | None:
        return (self.context.get("live") or {}).get(str(node.id))

    def _figures(self, node: Node):
        from nodes.selectors import node_figures

        return node_figures(node=node, beat=self.get_live(node))

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_lanes(self, node: Node) -> int | None:
        return self._figures(node).lanes

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_lanes_busy(self, node: Node) -> int | None:
        return self._figures(node).lanes_busy

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_tokens_per_s(self, node: Node) -> float | None:
        return self._figures(node).tokens_per_s

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_models(self, node: Node) -> list[dict]:
        return [{"name": name, **f.as_dict()} for name, f in self._figures(node).models.items()]

    @extend_schema_field(serializers.DictField())
    def get_device(self, node: Node) -> dict:
        from nodes.selectors import node_device

        report = node_device(node=node, beat=self.get_live(node))
        return {**report.to_wire(), "cpu_fallback": report.cpu_fallback, "line": report.line()}

    def get_connected(self, node: Node) -> bool:
        return str(node.id) in (self.context.get("connected") or set())


class FleetTokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = FleetToken
        fields = ["id", "name", "public_id", "is_active", "created_at", "revoked_at", "last_used_at"]
        read_only_fields = ["id", "public_id", "is_active", "created_at", "revoked_at", "last_used_at"]


class FleetTokenCreatedSerializer(FleetTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="`<public id>.<secret>`; shown only this once.")

    class Meta(FleetTokenSerializer.Meta):
        fields = [*FleetTokenSerializer.Meta.fields, "token"]


class ApiKeySerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.get_username", read_only=True)
    limits = serializers.SerializerMethodField(help_text="The quotas in force: the key's own (set by staff in the "
                                               "admin) or the FLEET_QUOTA_* defaults; 0 is unlimited.")

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "owner", "is_active", "created_at", "revoked_at", "last_used_at",
                  "requests_per_minute", "tokens_per_minute", "tokens_per_day", "concurrent_streams", "limits",
                  "priority", "weight", "max_waiting"]
        read_only_fields = ["id", "prefix", "is_active", "created_at", "revoked_at", "last_used_at",
                            "requests_per_minute", "tokens_per_minute", "tokens_per_day", "concurrent_streams"]

    @extend_schema_field(serializers.DictField(child=serializers.IntegerField()))
    def get_limits(self, key: ApiKey) -> dict[str, int]:
        return dataclasses.asdict(limits_for(key))


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key; shown only this once. Use it as a Bearer token.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class MessageSerializer(serializers.ModelSerializer):
    class Meta:
        model = Message
        fields = ["index", "role", "content", "name", "tool_calls", "tool_call_id", "token_count", "generation",
                  "created_at"]
        read_only_fields = fields


class MessageInSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Message.Role.choices)
    content = serializers.CharField(allow_blank=True, required=False, allow_null=True)
    name = serializers.CharField(required=False, allow_blank=True)
    tool_calls = serializers.ListField(child=serializers.DictField(), required=False)
    tool_call_id = serializers.CharField(required=False, allow_blank=True)

    def validate_tool_calls(self, value):
        problem = nul_problem(value, "tool_calls")
        if problem:
            raise serializers.ValidationError(problem)
        return value


class SessionSerializer(serializers.ModelSerializer):
    messages = MessageInSerializer(many=True, required=False, write_only=True,
                                   help_text="Messages to seed the conversation with (optional).")
    message_count = serializers.SerializerMethodField(help_text="How many messages the session holds.")

    class Meta:
        model = InferenceSession
        fields = ["id", "model", "title", "system_prompt", "metadata", "messages", "message_count", "created_at",
                  "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at", "message_count"]

    def validate_metadata(self, value):
        problem = nul_problem(value, "metadata")
        if problem:
            raise serializers.ValidationError(problem)
        return value

    def get_message_count(self, session: InferenceSession) -> int:
        # Lists annotate the count; a session just created or updated is counted here.
        count = getattr(session, "message_count", None)
        return session.messages.count() if count is None else count


class SessionDetailSerializer(SessionSerializer):
    history = MessageSerializer(source="messages", many=True, read_only=True)

    class Meta(SessionSerializer.Meta):
        fields = [*SessionSerializer.Meta.fields, "history"]


class ContinueSerializer(serializers.Serializer):
    """Continue a session: the new user message (or messages) and, optionally, /v1 chat parameters."""

    content = serializers.CharField(required=False, help_text="The user's new message.")
    messages = MessageInSerializer(many=True, required=False, help_text="Or several new messages.")
    stream = serializers.BooleanField(required=False, default=False, help_text="Answer as SSE chunks.")
    model = serializers.CharField(required=False, help_text="Defaults to the session's model.")
    max_tokens = serializers.IntegerField(required=False, min_value=1)
    temperature = serializers.FloatField(required=False)
    deadline_ms = serializers.IntegerField(required=False, min_value=1)

    def validate(self, attrs):
        if not attrs.get("content") and not attrs.get("messages"):
            raise serializers.ValidationError("Send the new message as `content`, or `messages`.")
        return attrs


class ContinueResultSerializer(serializers.Serializer):
    session = serializers.UUIDField()
    generation = serializers.UUIDField()
    message = serializers.DictField(help_text="The assistant's answer, as stored.")
    finish_reason = serializers.CharField()
    usage = serializers.DictField()
    node = serializers.CharField()


class GrammarHandleSerializer(serializers.ModelSerializer):
    source = serializers.JSONField(help_text="GBNF text, or a JSON schema (an object, or its JSON text).")

    class Meta:
        model = GrammarHandle
        fields = ["id", "name", "kind", "source", "created_at", "freed_at"]
        read_only_fields = ["id", "created_at", "freed_at"]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if instance.kind == GrammarHandle.Kind.JSON_SCHEMA:
            with contextlib.suppress(ValueError):
                data["source"] = json.loads(instance.source)
        return data


class LogitBiasHandleSerializer(serializers.ModelSerializer):
    # Explicit: the model's default of {} made the field optional, and a body without it reached the view.
    bias = serializers.DictField(child=serializers.FloatField(min_value=-100, max_value=100),
                                 help_text='Token id to bias, e.g. {"1234": -100}; biases from -100 to 100.')

    class Meta:
        model = LogitBiasHandle
        fields = ["id", "name", "bias", "created_at", "freed_at"]
        read_only_fields = ["id", "created_at", "freed_at"]


class GenerationSerializer(serializers.ModelSerializer):
    node_identity = serializers.CharField(source="node.identity", read_only=True, default=None, allow_null=True)

    class Meta:
        model = Generation
        fields = ["id", "kind", "model", "status", "finish_reason", "session", "node", "node_identity", "nodes_used",
                  "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "duration_ms", "decode_tps",
                  "parameters", "placement", "trace_id", "error", "created_at", "finished_at"]
        read_only_fields = fields


class FleetStatusSerializer(serializers.Serializer):
    models = serializers.ListField(child=serializers.DictField())
    nodes = serializers.ListField(child=serializers.DictField())
    lanes_total = serializers.IntegerField()
    lanes_busy = serializers.IntegerField()
    lanes_free = serializers.IntegerField()
    queue_length = serializers.IntegerField()
