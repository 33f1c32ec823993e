"""Deployments: registry models put on nodes chosen by name or by label, and where each node-model pair stands.

The head tells each node over its link what its deployments put there (`deploy`, the whole list each time: after it
registers, and whenever a deployment changes). A model moved off a node stays there until a node it moved to serves
it (make before break), so a client asking for it never finds no node serving it.
"""

from __future__ import annotations

import re

from django.db import transaction

from nodes.link.codes import ModelPhase
from nodes.models import Deployment, Model, Node, NodeModel
from nodes.tell import tell_nodes

MAX_LANES = 256
MAX_CONTEXT = 1 << 20
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")


class DeploymentError(ValueError):
    """A deployment that cannot be made as asked; says what to change."""


def deployment_check(*, nodes: list, labels: dict, lanes: int, context: int, model: Model | None = None) -> None:
    """Raises DeploymentError unless the model, the selector and the sizes make a deployment."""
    if model is not None and model.is_attachment:
        raise DeploymentError(f"{model.name!r} is a {model.get_kind_display()}: deploy its base {model.base.name!r}, "
                              "and every node serving that loads it")
    if not isinstance(nodes, list) or not all(isinstance(n, str) and 0 < len(n) <= 200 and "\x00" not in n
                                              for n in nodes):
        raise DeploymentError("nodes must be a list of node identities (the names they joined with)")
    if not isinstance(labels, dict) or not all(isinstance(k, str) and LABEL_RE.fullmatch(k) and isinstance(v, str)
                                               and len(v) <= 200 and "\x00" not in v for k, v in labels.items()):
        raise DeploymentError("labels must map label names to string values, as node_join --label KEY=VALUE sets")
    if not nodes and not labels:
        raise DeploymentError("choose the nodes: name them in nodes, or give labels they must have")
    if not 1 <= lanes <= MAX_LANES:
        raise DeploymentError(f"lanes must be from 1 to {MAX_LANES}")
    if not 0 <= context <= MAX_CONTEXT:
        raise DeploymentError(f"context must be from 0 (sized for each node) to {MAX_CONTEXT} tokens")


@transaction.atomic
def deployment_create(*, model: Model, nodes: list, labels: dict, lanes: int = 4, context: int = 0) -> Deployment:
    """Put `model` on the chosen nodes; each is told over its link once this commits."""
    deployment_check(nodes=nodes, labels=labels, lanes=lanes, context=context, model=model)
    deployment = Deployment.objects.create(model=model, nodes=nodes, labels=labels, lanes=lanes, context=context)
    deployments_changed()
    return deployment


@transaction.atomic
def deployment_update(*, deployment: Deployment, **changes) -> Deployment:
    """Change the model, nodes, labels, lanes or context; nodes that stop matching unload it once another serves it.
    Lanes and context apply where it loads next (a node serving it keeps its worker)."""
    for name, value in changes.items():
        setattr(deployment, name, value)
    deployment_check(nodes=deployment.nodes, labels=deployment.labels, lanes=deployment.lanes,
                     context=deployment.context, model=deployment.model)
    deployment.save()
    deployments_changed()
    return deployment


@transaction.atomic
def deployment_delete(*, deployment: Deployment) -> None:
    """Take the model off its nodes (each drains it: what runs there finishes)."""
    deployment.delete()
    deployments_changed()


# --- what a node should serve ----------------------------------------------------------------------------------


def node_deployments(*, node_id) -> list[dict]:
    """The `deploy` list for a node: the models its deployments choose, those it serves for a deployment that moved
    away while no node the deployment chooses serves them yet, and those the head loaded there on demand."""
    from nodes.on_demand import node_on_demand

    node = Node.objects.get(pk=node_id)
    deployments = list(Deployment.objects.select_related("model").order_by("created_at"))
    wanted = {d.model.name: d for d in deployments if d.matches(node)}
    on_demand = {name: row for name, row in node_on_demand(node=node).items() if name not in wanted}
    for pair in (NodeModel.objects.filter(node=node, state=NodeModel.State.SERVING, on_demand=False)
                 .exclude(model__in=list(wanted)).exclude(model__in=Model.objects.filter(on_demand=True)
                                                          .values("name"))):
        moved = [d for d in deployments if d.model.name == pair.model]
        if moved and not _served_as_chosen(pair.model, moved, exclude=node):
            wanted[pair.model] = moved[-1]
    projectors = {p.base.name: {"name": p.name, "sha256": p.sha256} for p in Model.objects.filter(
        kind=Model.Kind.PROJECTOR, base__name__in=[*wanted, *on_demand]).select_related("base")}
    rows = [{"name": name, "sha256": d.model.sha256, "lanes": d.lanes, "context": d.context}
            for name, d in wanted.items()] + list(on_demand.values())
    return [{**row, **({"mmproj": projectors[row["name"]]} if row["name"] in projectors else {})} for row in rows]


def node_adapters(*, node_id) -> dict[str, list[dict]]:
    """The `deploy` message's adapters for a node: the registry's LoRA adapters of each model it serves or is told to
    load, by base model name."""
    node = Node.objects.get(pk=node_id)
    bases = set(node.models_served) | {d.model.name for d in Deployment.objects.select_related("model")
                                       if d.matches(node)}
    adapters: dict[str, list[dict]] = {}
    for adapter in (Model.objects.filter(base__name__in=bases, kind=Model.Kind.ADAPTER).select_related("base")
                    .order_by("name")):
        adapters.setdefault(adapter.base.name, []).append({"name": adapter.name, "sha256": adapter.sha256})
    return adapters


def _served_as_chosen(model: str, deployments: list[Deployment], *, exclude: Node) -> bool:
    pairs = (NodeModel.objects.filter(model=model, state=NodeModel.State.SERVING).exclude(node=exclude)
             .exclude(node__state=Node.State.OFFLINE).select_related("node"))
    return any(d.matches(pair.node) for pair in pairs for d in deployments)


# --- what nodes report ---------------------------------------------------------------------------------------------


def node_model_record(*, node_id, model: str, state: str, progress: float = 0.0, detail: str = "") -> list[str]:
    """Keep what a node reported of a deployed model (`unloaded` forgets the pair). Returns the other nodes to tell
    their deployments again: when it starts serving, those keeping it for a deployment that moved here let it go."""
    if state == ModelPhase.UNLOADED:
        NodeModel.objects.filter(node_id=node_id, model=model).delete()
        return []
    if not Model.objects.filter(name=model).exists():
        return []  # not a registry model (or deleted since): nothing is deployed under that name
    was = NodeModel.objects.filter(node_id=node_id, model=model).values_list("state", flat=True).first()
    NodeModel.objects.update_or_create(node_id=node_id, model=model, defaults={
        "state": state, "progress": max(0.0, min(progress, 1.0)), "detail": detail[:500]})
    if state != ModelPhase.SERVING or was == ModelPhase.SERVING:
        return []  # only a pair that starts serving lets others go (a node says `serving` again at every deploy)
    others = NodeModel.objects.filter(model=model).exclude(node_id=node_id).values_list("node_id", flat=True)
    return [str(pk) for pk in others]


def node_models_forget(*, node_id, keep: list[str]) -> None:
    """A node (re)joined serving `keep`: the pairs of other models are gone with its last run (a BASE:ADAPTER it
    serves keeps the adapter's pair)."""
    adapters = [name.partition(":")[2] for name in keep if ":" in name]
    NodeModel.objects.filter(node_id=node_id).exclude(model__in=[*keep, *adapters]).delete()


def node_models_set(*, node_id, names: list[str], lanes: int | None = None, capabilities: dict | None = None) -> None:
    """The models a node now serves (it loaded or unloaded one, or an adapter), with all its engines' lanes, and its
    capabilities when an adapter changed them; a transition, written once."""
    changed: dict = {"models_served": names, **({} if lanes is None else {"lanes": lanes}),
                     **({} if capabilities is None else {"capabilities": capabilities})}
    Node.objects.filter(pk=node_id).update(**changed)


def deployments_changed() -> None:
    """Once this transaction commits, have every online node's link send the node its deployments again."""
    transaction.on_commit(_tell_online_nodes)


def _tell_online_nodes() -> None:
    tell_nodes([str(pk) for pk in Node.objects.exclude(state=Node.State.OFFLINE).values_list("pk", flat=True)])


def model_node_states(*, model: Model) -> list[NodeModel]:
    """Every node's pair for a registry model or adapter, as the nodes last reported them."""
    return list(NodeModel.objects.filter(model=model.name).select_related("node").order_by("node__identity"))


def deployment_states(*, deployment: Deployment) -> list[NodeModel]:
    """Every node-model pair of the deployment's model and of its LoRA adapters, as the nodes last reported them."""
    names = [deployment.model.name, *deployment.model.adapters.values_list("name", flat=True)]
    return list(NodeModel.objects.filter(model__in=names).select_related("node").order_by("model", "node__identity"))
