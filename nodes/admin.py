"""Admin for nodes and fleet tokens: the operator's view of who is in the fleet and with which credential."""

import copy

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from fleet.display import size_text, when_text
from nodes import on_demand
from nodes.deployments import (
    DeploymentError,
    deployment_check,
    deployment_create,
    deployment_delete,
    deployment_states,
    deployment_update,
    model_node_states,
)
from nodes.link.device import DeviceReport
from nodes.models import Deployment, FleetToken, Model, ModelAlias, Node, RevokedNodeKey
from nodes.registry import model_delete
from nodes.services import (
    fleet_token_create,
    fleet_token_head_address,
    fleet_token_join_lines,
    fleet_token_revoke,
    node_release_key,
    node_revoke,
    node_set_hold,
)


def _device_html(report: DeviceReport):
    """The device line; a CPU run on a host with a GPU in orange, so the operator sees it is not using the GPU."""
    if report.cpu_fallback:
        return format_html('<b style="color:#e65100">{}</b>', report.line())
    return report.line()


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    empty_hint = ("No node has joined yet. Make a fleet token (Fleet tokens, Add; or `manage.py fleet_token`) and run "
                  "the line it prints on a node host: `FLEET_TOKEN=… make node HEAD=…`.")
    list_display = ("identity", "state_badge", "models_list", "device_line", "lanes", "context_window", "address",
                    "key_fingerprint", "last_seen_at")
    list_filter = ("state", "hold", "engine")
    search_fields = ("identity", "address")
    readonly_fields = ("id", "identity", "models_served", "lanes", "context_window", "state", "address", "version",
                       "engine", "device_now", "capabilities", "replicas", "live", "links", "token", "key_fingerprint",
                       "key_bound_at", "joined_at", "last_seen_at", "created_at", "updated_at")
    fields = ("id", "identity", "state", "hold", "labels", "models_served", "lanes", "context_window", "live",
              "links", "address", "version", "engine", "device_now", "capabilities", "replicas", "token",
              "key_fingerprint",
              "key_bound_at", "joined_at", "last_seen_at", "created_at", "updated_at")
    list_select_related = ("token",)
    actions = ("drain", "cordon", "uncordon", "release_key", "revoke")

    def has_add_permission(self, request):
        return False  # nodes join with `manage.py node_join`

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The node's page: its models and replicas with their states, recent generations and link history."""
        from nodes.selectors import node_device, node_figures, node_link_history, node_replicas
        from sessions.selectors import generation_list_recent

        node = self.get_object(request, object_id)
        if node is not None:
            beat, replicas = node_replicas(node=node)
            figures = node_figures(node=node, beat=beat)
            extra_context = {**(extra_context or {}), "beat": beat, "replicas": replicas, "figures": figures,
                             "generations": generation_list_recent(node_id=node.pk),
                             "link_events": node_link_history(node=node),
                             "device": node_device(node=node, beat=beat)}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="state", ordering="state")
    def state_badge(self, node):
        colour = {"online": "#2e7d32", "offline": "#999", "draining": "#e65100", "cordoned": "#e65100"}[node.state]
        return format_html('<b style="color:{}">{}</b>', colour, node.state)

    @admin.display(description="device")
    def device_line(self, node):
        """As the node registered (the list reads no heartbeat): backend, GPUs, layers, memory."""
        return _device_html(DeviceReport.from_wire(node.device))

    @admin.display(description="device")
    def device_now(self, node):
        """What its engines run on, the GPUs' memory from the last heartbeat (else as it registered)."""
        from django.core.cache import cache

        from fleet.names import liveness_key
        from nodes.selectors import node_device

        return _device_html(node_device(node=node, beat=cache.get(liveness_key(str(node.pk)))))

    @admin.display(description="links (head processes)")
    def links(self, node):
        """Which head processes hold a link to the node (each one's link URL), and since when."""
        from fleet.links import registry

        rows = registry().heads.node_links(str(node.pk))
        if not rows:
            return "none (offline)"
        return format_html_join(format_html("<br>"), "{} since {}", ((url, when_text(since)) for url, since in rows))

    @admin.display(description="live (last heartbeat)")
    def live(self, node):
        """Lanes, KV use, speed and per-replica state from the last heartbeat (kept with a TTL, not in the row)."""
        from nodes.selectors import node_beats, node_figures

        beat = node_beats([node.pk]).get(str(node.pk))
        if not beat:
            return "no heartbeat (offline, or just joined)"
        replicas = "; ".join(
            f"replica {r['index']}: {'alive' if r.get('alive') else 'DOWN'}, {r.get('running', 0)} running, "
            f"{r.get('routed', 0)} routed" for r in beat.get("replicas") or [])
        shown = node_figures(node=node, beat=beat)
        return format_html("{} / {} lanes busy, KV {} / {}, {} tokens/s{}<br>{}", shown.lanes_busy, shown.lanes,
                           shown.kv_used, shown.kv_total, round(shown.tokens_per_s or 0.0, 1),
                           f" — {replicas}" if replicas else "", self._pace(node, beat))

    @staticmethod
    def _pace(node, beat) -> str:
        """What the node's engine measured of its own speed, and the load cost placement learned from it."""
        from django.conf import settings

        from fleet.links import registry

        prefill, slowdown = beat.get("prefill_tps") or 0.0, beat.get("decode_slowdown_ms") or 0.0
        if not prefill:
            return "engine pace: not measured yet (it is, from the first generations' steps)"
        slot = next((s for s in registry().placement.nodes() if s.node_id == str(node.pk)), None)
        if settings.FLEET_LOAD_TOKENS is not None:
            load = f"{settings.FLEET_LOAD_TOKENS} prompt tokens (FLEET_LOAD_TOKENS)"
        else:
            load = f"{slot.learned_load_tokens} prompt tokens (learned)" if slot else "unknown (no link here)"
        return (f"engine pace: reads prompts at {prefill:,.0f} tokens/s; each running generation adds "
                f"{slowdown:.2f} ms to a decode step; load cost per running generation: {load}")

    @admin.display(description="key fingerprint")
    def key_fingerprint(self, node):
        return node.key_fingerprint or "(unbound: the next join binds its key)"

    @admin.display(description="models")
    def models_list(self, node):
        return ", ".join(node.models_served)

    def _hold(self, request, queryset, hold, verb):
        for node in queryset:
            node_set_hold(node=node, hold=hold)
        self.message_user(request, f"{queryset.count()} node(s) {verb}.", messages.SUCCESS)

    @admin.action(description="Drain: take no new generations, finish running ones")
    def drain(self, request, queryset):
        self._hold(request, queryset, Node.Hold.DRAIN, "draining")

    @admin.action(description="Cordon: take no new generations")
    def cordon(self, request, queryset):
        self._hold(request, queryset, Node.Hold.CORDON, "cordoned")

    @admin.action(description="Uncordon: take new generations again")
    def uncordon(self, request, queryset):
        self._hold(request, queryset, Node.Hold.NONE, "back in service")

    @admin.action(description="Release key binding: the next node to join under this identity binds its own key")
    def release_key(self, request, queryset):
        count = sum(node_release_key(node=node) for node in queryset)
        self.message_user(request, f"{count} identity binding(s) released.", messages.SUCCESS)

    @admin.action(description="Revoke: close the node's link now; its key can never rejoin")
    def revoke(self, request, queryset):
        count = sum(node_revoke(node=node) for node in queryset)
        self.message_user(request, f"{count} node key(s) revoked; their links are closing.", messages.SUCCESS)

    def save_model(self, request, obj, form, change):
        # The hold goes through its service so the node's live link hears about it.
        if change and "hold" in form.changed_data:
            node_set_hold(node=obj, hold=obj.hold)
            obj.refresh_from_db()
        super().save_model(request, obj, form, change)


@admin.register(FleetToken)
class FleetTokenAdmin(admin.ModelAdmin):
    empty_hint = ("No fleet token yet. Add one: it is shown once, with the line a node host runs to join.")
    list_display = ("name", "public_id", "active", "created_at", "expires_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "public_id")
    readonly_fields = ("public_id", "created_at", "last_used_at", "revoked_at")
    fields = ("name", "public_id", "expires_at", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke",)

    @admin.display(boolean=True)
    def active(self, token):
        return token.is_active

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        token, secret = fleet_token_create(name=obj.name, expires_at=obj.expires_at)
        obj.pk, obj.public_id, obj.secret_encrypted = token.pk, token.public_id, token.secret_encrypted
        obj._state.adding = False
        head, warning = fleet_token_head_address(request_host=request.get_host())
        lines = fleet_token_join_lines(head=head, secret=secret)
        self.message_user(
            request,
            format_html("Token created; it is shown only this once: <code>{}</code><br>{}{}", secret,
                        format_html_join("", "{}<br>", ((line,) for line in lines)),
                        f"Warning: {warning}" if warning else ""),
            messages.WARNING,
        )

    @admin.action(description="Revoke: close the links of nodes that joined with it; no new joins")
    def revoke(self, request, queryset):
        count = sum(fleet_token_revoke(token=t) for t in queryset)
        self.message_user(request, f"{count} token(s) revoked.", messages.SUCCESS)


@admin.register(RevokedNodeKey)
class RevokedNodeKeyAdmin(admin.ModelAdmin):
    """Keys revoked with the node action; deleting a row lets that key join again."""

    list_display = ("identity", "fingerprint", "created_at")
    search_fields = ("identity", "public_key")
    readonly_fields = ("identity", "public_key", "fingerprint", "created_at")
    fields = readonly_fields

    def has_add_permission(self, request):
        return False  # revoke from the node list

    @admin.display(description="key fingerprint")
    def fingerprint(self, row):
        from nodes.link.handshake import fingerprint

        return fingerprint(bytes.fromhex(row.public_key))


def _pairs(pairs, *, empty: str) -> str:
    """Each node-model pair as `node: state` lines (pulling 43%, serving, failed: why)."""
    if not pairs:
        return empty
    return format_html_join("", "{}: {}<br>", ((p.node.identity, p.describe()) for p in pairs))


class ModelOnDemandForm(forms.ModelForm):
    """The registry entry's one editable part: its on-demand settings, checked as /api/models/ checks them."""

    class Meta:
        model = Model
        fields = ("on_demand", "min_replicas", "max_replicas", "keep_alive_s")
        help_texts = {"on_demand": ""}  # the fieldset's description says it, for an operator rather than in code terms

    def clean(self):
        cleaned = super().clean()
        asked = copy.copy(self.instance)  # the instance takes the form's values only after clean()
        for name in self.Meta.fields:
            if name in cleaned:
                setattr(asked, name, cleaned[name])
        try:
            on_demand.on_demand_check(asked)
        except on_demand.OnDemandError as exc:
            raise forms.ValidationError(str(exc)) from None
        return cleaned


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    """The model registry. Adding uploads the file in parts through /api/models/ (see the add page's script), so the
    head never holds more than one part in memory; every figure comes from the file's own metadata."""
    empty_hint = ("The registry is empty. Add a model to upload a GGUF file nodes can pull (the bundled smollm2 is "
                  "served by nodes without being here); then deploy it (Deployments).")

    list_display = ("name", "kind", "base", "architecture", "quantization", "file_size", "context_length",
                    "kv_per_token", "on_demand", "sha256_short", "created_at")
    fieldsets = ((None, {"fields": ("id", "name", "kind", "base", "on_nodes", "sha256", "file_size", "architecture",
                                    "quantization", "context_length", "kv_per_token", "chat_template",
                                    "created_at", "updated_at")}),
                 ("On demand", {"fields": ("on_demand", "min_replicas", "max_replicas", "keep_alive_s"),
                                "description": "Loaded where there is room when a request names it and no node "
                                               "serves it; more replicas while its queue waits; unloaded when idle "
                                               "for its keep-alive (docs/operations.md, On-demand models)."}))
    search_fields = ("name", "sha256", "architecture")
    readonly_fields = ("id", "name", "kind", "base", "on_nodes", "sha256", "file_size", "architecture",
                       "quantization", "context_length", "kv_per_token", "chat_template", "created_at", "updated_at")

    def add_view(self, request, form_url="", extra_context=None):
        from django.conf import settings
        from django.template.response import TemplateResponse

        context = {**self.admin_site.each_context(request), "opts": self.model._meta, "title": "Add a model",
                   "part_bytes": settings.FLEET_MAX_BODY_BYTES, "has_view_permission": True}
        return TemplateResponse(request, "admin/nodes/model/upload.html", context)

    def changelist_view(self, request, extra_context=None):
        """With the registry's entries, the models nodes serve from their own files (the bundled smollm2, a
        --model path): served, but not in the registry, so an operator does not read "0 models" as "none"."""
        from nodes.selectors import node_models_served

        registered = set(Model.objects.values_list("name", flat=True))
        own = [name for name in node_models_served() if name not in registered and ":" not in name]
        note = (f"Also served now by nodes from their own files (no registry entry, nothing to pull): "
                f"{', '.join(own)}.") if own else ""
        return super().changelist_view(request, {**(extra_context or {}), "fleet_note": note})

    form = ModelOnDemandForm

    def save_model(self, request, obj, form, change):
        """Only the on-demand settings change (every other field is read from the file)."""
        on_demand.model_on_demand_update(model=obj)

    def delete_model(self, request, obj):
        model_delete(model=obj)

    def delete_queryset(self, request, queryset):
        for model in queryset:
            model_delete(model=model)

    @admin.display(description="on nodes")
    def on_nodes(self, model):
        """Each node's state for it (a deployed model, or an adapter of a model nodes serve), as last reported."""
        return _pairs(model_node_states(model=model), empty="no node reported it")

    @admin.display(description="size", ordering="size")
    def file_size(self, model):
        return size_text(model.size)

    @admin.display(description="KV cache a token", ordering="kv_bytes_per_token")
    def kv_per_token(self, model):
        """K and V of one token in every layer (f16): what a lane's context costs in memory, token by token."""
        return size_text(model.kv_bytes_per_token)

    @admin.display(description="sha256")
    def sha256_short(self, model):
        return f"{model.sha256[:12]}…"


class DeploymentForm(forms.ModelForm):
    """Nodes chosen from those the fleet knows, labels written as key=value pairs: no JSON to type."""

    nodes = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                      help_text="Nodes to put the model on; or choose them by labels below.")
    labels = forms.CharField(required=False, help_text="Every node whose labels include all of these (node_join "
                             "--label), including nodes that join later: gpu=a100, zone=eu-1")

    class Meta:
        model = Deployment
        fields = ("model", "nodes", "labels", "lanes", "context")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        chosen = list(self.instance.nodes or []) if self.instance.pk else []
        known = sorted(set(Node.objects.values_list("identity", flat=True)) | set(chosen))
        self.fields["nodes"].choices = [(name, name) for name in known]
        if self.instance.pk:
            self.initial["labels"] = ", ".join(f"{k}={v}" for k, v in (self.instance.labels or {}).items())

    def clean_labels(self) -> dict[str, str]:
        pairs = {}
        for part in filter(None, (p.strip() for p in (self.cleaned_data.get("labels") or "").split(","))):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise forms.ValidationError(f"{part!r}: write each label as key=value, separated by commas")
            pairs[key.strip()] = value.strip()
        return pairs

    def clean(self):
        data = super().clean()
        try:
            deployment_check(nodes=data.get("nodes") or [], labels=data.get("labels") or {},
                             lanes=data.get("lanes") or 0, context=data.get("context") or 0, model=data.get("model"))
        except DeploymentError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """Put a registry model on nodes by name or label; each node-model pair's state as the nodes report it."""
    empty_hint = ("No deployment. Add one to put a registry model on nodes, chosen by name or by label.")

    form = DeploymentForm
    list_display = ("model", "nodes", "labels", "lanes", "context", "states")
    list_select_related = ("model",)
    readonly_fields = ("states", "created_at", "updated_at")
    fields = ("model", "nodes", "labels", "lanes", "context", "states", "created_at", "updated_at")

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in DeploymentForm.Meta.fields}
        if change:
            deployment_update(deployment=obj, **values)
        else:
            obj.pk = deployment_create(**values).pk

    def delete_model(self, request, obj):
        deployment_delete(deployment=obj)

    def delete_queryset(self, request, queryset):
        for deployment in queryset:
            deployment_delete(deployment=deployment)

    @admin.display(description="on the nodes")
    def states(self, deployment):
        return _pairs(deployment_states(deployment=deployment), empty="no node reported it yet")


@admin.register(ModelAlias)
class ModelAliasAdmin(admin.ModelAdmin):
    """Names clients send (a hosted model's, an agent's background model's) for a served model, in every API."""

    list_display = ("name", "target", "created_at")
    search_fields = ("name", "target")
