"""Durable records of the fleet's nodes and the tokens they join with."""

import uuid

from django.db import models
from django.utils import timezone

from nodes.link.handshake import fingerprint


class Node(models.Model):
    """A host that joined the fleet with `manage.py node_join` and serves one or more models.

    `state` changes only on transitions (joined, lost, drained, cordoned); live load lives in memory
    or Redis with a TTL, never in this row.
    """

    class State(models.TextChoices):
        ONLINE = "online", "online"
        DRAINING = "draining", "draining"
        CORDONED = "cordoned", "cordoned"
        OFFLINE = "offline", "offline"

    class Hold(models.TextChoices):
        NONE = "", "none"
        DRAIN = "drain", "drain"
        CORDON = "cordon", "cordon"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    identity = models.CharField(max_length=200, unique=True, help_text="Name the node joined with (host name).")
    models_served = models.JSONField(default=list, blank=True, help_text="Model names the head matches on.")
    model_files = models.JSONField(default=dict, blank=True, help_text=(
        "Its own model's file fingerprint, by the name it serves it under (what lets another node's copy of the "
        "same file take that name)."))
    lanes = models.PositiveIntegerField(default=0)
    context_window = models.PositiveIntegerField(default=0)
    state = models.CharField(max_length=16, choices=State.choices, default=State.OFFLINE, db_index=True)
    hold = models.CharField(max_length=16, choices=Hold.choices, default=Hold.NONE, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    address = models.CharField(max_length=200, blank=True)
    version = models.CharField(max_length=100, blank=True)
    engine = models.CharField(max_length=100, blank=True)
    capabilities = models.JSONField(default=dict, blank=True)
    replicas = models.JSONField(default=list, blank=True)
    device = models.JSONField(
        default=dict, blank=True,
        help_text="What its engine workers run on, as it registered (nodes.link.device: backend, GPUs and their "
                  "memory, layers offloaded, the host's GPUs); {} for a node that does not say.")
    token = models.ForeignKey("nodes.FleetToken", null=True, blank=True, on_delete=models.SET_NULL)
    public_key = models.CharField(
        max_length=64, blank=True, db_index=True,
        help_text="The node's static link key (hex) this identity is bound to; blank until the next join binds one.",
    )
    key_bound_at = models.DateTimeField(null=True, blank=True)
    joined_at = models.DateTimeField(null=True, blank=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["identity"]

    def __str__(self) -> str:
        return self.identity

    @property
    def schedulable(self) -> bool:
        return self.state == self.State.ONLINE

    @property
    def key_fingerprint(self) -> str:
        return fingerprint(bytes.fromhex(self.public_key)) if self.public_key else ""


class RevokedNodeKey(models.Model):
    """A node key the operator revoked: it can never rejoin, under any identity or token."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    public_key = models.CharField(max_length=64, unique=True)
    identity = models.CharField(max_length=200, blank=True, help_text="The identity it held when it was revoked.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.identity or 'node'} key {self.public_key[:12]}…"


class HeadKey(models.Model):
    """The head's static link key, one for every head process (they share the database). Nodes pin its public half.

    The private half is sealed like token secrets (MultiFernet over SECRET_KEY and SECRET_KEY_FALLBACKS).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=32, unique=True, default="head")
    public_key = models.CharField(max_length=64)
    private_key_encrypted = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"head key {self.public_key[:12]}…"


class FleetToken(models.Model):
    """A credential nodes join with: `<public_id>.<secret>`.

    The secret keys the link's Noise handshake (as its PSK), so the head must be able to read it back:
    it is kept encrypted with a key derived from SECRET_KEY, never in clear.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200)
    public_id = models.CharField(max_length=32, unique=True)
    secret_encrypted = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="No new joins after this; blank: never.")
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


class LinkEvent(models.Model):
    """One moment of a node's link history for its admin page: it joined or rejoined, its link dropped, or the head
    refused it (with the close code). Refusals before registration have no node, only what the peer claimed.

    Written on transitions only, never per heartbeat; capped per node (and for node-less refusals) by
    `nodes.services.link_event_record`, so a node that flaps or a peer that keeps failing the handshake cannot
    grow the table.
    """

    class Kind(models.TextChoices):
        JOINED = "joined", "joined"
        REJOINED = "rejoined", "rejoined"
        DROPPED = "dropped", "dropped"
        REFUSED = "refused", "refused"
        LOADED = "loaded", "loaded a model on demand"
        UNLOADED = "unloaded", "unloaded an on-demand model"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.CASCADE, related_name="link_events")
    identity = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    peer = models.CharField(max_length=200, blank=True, help_text="The address the link came from.")
    code = models.IntegerField(null=True, blank=True, help_text="The websocket close code, for drops and refusals.")
    detail = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["node", "-created_at"], name="linkevent_node_recent")]

    def __str__(self) -> str:
        return f"{self.identity or 'node'} {self.kind}"


class Model(models.Model):
    """A GGUF model in the head's registry, stored once by content hash under `$FLEET_HOME/blobs/`.

    Every figure is read from the file's own metadata when it is added (`nodes.registry.model_add`), never typed by
    hand. Several names may share one file; the blob goes when the last of them is deleted. A LoRA adapter is an entry
    with a `base`: every node serving the base loads it, and clients ask for it as `base:adapter`. A projector (mmproj)
    is an entry with a `base` too: a deployment of the base loads it, so the model reads images.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=64, unique=True, help_text="The name nodes pull and clients ask for.")
    sha256 = models.CharField(max_length=64, db_index=True, editable=False)
    size = models.PositiveBigIntegerField(editable=False, help_text="Bytes.")
    architecture = models.CharField(max_length=64, editable=False)
    tokenizer = models.CharField(
        max_length=64, blank=True, editable=False,
        help_text="The sha256 fingerprint of its tokenizer (nodes.agent.vocab); blank until first needed.")
    quantization = models.CharField(max_length=32, editable=False)
    context_length = models.PositiveIntegerField(editable=False, help_text="The context the model was trained for.")
    kv_bytes_per_token = models.PositiveBigIntegerField(
        editable=False, help_text="KV cache bytes of one token in every layer (K and V, f16).")
    chat_template = models.TextField(blank=True, editable=False)
    class Kind(models.TextChoices):
        MODEL = "model", "model"
        ADAPTER = "adapter", "LoRA adapter"
        PROJECTOR = "projector", "multimodal projector"

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.MODEL, editable=False,
                            help_text="Read from the file: a model, a LoRA adapter or an image projector (mmproj).")
    base = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="adapters", editable=False,
        help_text="For a LoRA adapter or a projector: the model it belongs to (nodes serving that model load it).")
    on_demand = models.BooleanField(
        default=False, help_text="Loaded where there is room when a request names it and no node serves it, scaled "
                                 "with its queue, unloaded when idle (nodes.on_demand).")
    min_replicas = models.PositiveIntegerField(
        default=0, help_text="On demand: nodes that keep it however idle (0: unloaded everywhere when idle).")
    max_replicas = models.PositiveIntegerField(
        default=1, help_text="On demand: the most nodes it is loaded on when its queue waits.")
    keep_alive_s = models.PositiveIntegerField(
        default=900, help_text="On demand: seconds a replica may sit idle before it is unloaded.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    @property
    def is_adapter(self) -> bool:
        return self.kind == self.Kind.ADAPTER

    @property
    def is_attachment(self) -> bool:
        """A LoRA adapter or a projector: loaded with its base, never deployed on its own."""
        return self.kind != self.Kind.MODEL

    def __str__(self) -> str:
        return self.name


class Deployment(models.Model):
    """A registry model put on nodes: those named in `nodes`, and those whose labels include every pair in `labels`.

    Each matching node is told over its link to load it (pulling it first) with `lanes` lanes of `context` tokens
    (0: sized for the node's free memory); a node that stops matching unloads it once another node serves it.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="deployments")
    nodes = models.JSONField(default=list, blank=True, help_text="Node identities to put the model on.")
    labels = models.JSONField(default=dict, blank=True,
                              help_text="Also every node with all these labels (node_join --label KEY=VALUE).")
    lanes = models.PositiveIntegerField(default=4, help_text="Lanes of the model's engine worker on each node.")
    context = models.PositiveIntegerField(
        default=0, help_text="Context window a lane, in tokens; 0 sizes it for each node's free memory.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.model.name} on {', '.join(self.nodes + [f'{k}={v}' for k, v in self.labels.items()])}"

    def matches(self, node: Node) -> bool:
        labels = node.labels or {}
        return node.identity in self.nodes or (
            bool(self.labels) and all(labels.get(k) == v for k, v in self.labels.items()))


class NodeModel(models.Model):
    """Where a deployed model stands on one node, as the node last reported it (`model_state` on the link): pulling
    (with its progress), loading, serving, draining, or failed and why. Gone when the node unloaded it."""

    class State(models.TextChoices):
        PULLING = "pulling", "pulling"
        LOADING = "loading", "loading"
        SERVING = "serving", "serving"
        DRAINING = "draining", "draining"
        FAILED = "failed", "failed"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="deployed_models")
    model = models.CharField(max_length=64, db_index=True)
    state = models.CharField(max_length=16, choices=State.choices)
    progress = models.FloatField(default=0.0, help_text="0..1 of the pull while pulling, of the load while loading.")
    detail = models.CharField(max_length=500, blank=True, help_text="Why it failed.")
    on_demand = models.BooleanField(
        default=False, help_text="The head put it here on demand (nodes.on_demand); cleared to unload it.")
    why = models.CharField(max_length=200, blank=True, help_text="Why the head loaded it here on demand.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model", "node__identity"]
        constraints = [models.UniqueConstraint(fields=["node", "model"], name="nodemodel_one_per_pair")]

    def __str__(self) -> str:
        return f"{self.model} on {self.node}: {self.describe()}"

    def describe(self) -> str:
        """pulling 43%, loading (40%), serving, failed: why; with the node's own state when it is not online (a pair
        the node last said was serving is not served while the node is offline or drained)."""
        if self.state == self.State.PULLING or (self.state == self.State.LOADING and self.progress):
            own = f"{self.state} {int(self.progress * 100)}%"
        elif self.state == self.State.FAILED:
            own = f"failed: {self.detail}"
        else:
            own = self.state
        return own if self.node.state == Node.State.ONLINE else f"{own} (node {self.node.state})"


class ModelAlias(models.Model):
    """Another name for a served model: agents ask for hosted models' names (and some for a second, smaller one for
    background work), which an operator maps here. Every API resolves it before placement (fleet.aliases)."""

    name = models.CharField(max_length=200, unique=True, help_text="The name a client sends.")
    target = models.CharField(max_length=200, help_text="The served model (or base:adapter) it stands for.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model alias"
        verbose_name_plural = "model aliases"

    def __str__(self) -> str:
        return f"{self.name} -> {self.target}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        self.name, self.target = self.name.strip(), self.target.strip()
        if not self.name or not self.target or self.name == self.target:
            raise ValidationError("An alias needs a name and another model's name as its target.")
