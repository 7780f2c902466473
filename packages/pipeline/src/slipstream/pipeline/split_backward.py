"""Backward split in two passes for the zero-bubble schedule: input gradients now, weights later.

[Note: splitting backward at the weight consumers] The input-gradient pass runs
``torch.autograd.grad(outputs, stage_inputs, retain_graph=True)``. Every autograd node it
executes that also feeds a weight (a matmul's node feeds the activation path and, through a
transpose, the weight's accumulator) is a *weight consumer*; a pre-hook records the gradient
arriving at each. The weight pass then restarts autograd at each consumer separately, asking
only for the gradient of its weight-side input edges, and pushes that into the weights.
Starting from all consumers at once would be wrong: from a consumer high in the stage,
autograd would follow the activation path down to lower consumers and count their weights
twice. Per consumer, nothing on the activation path is recomputed.

When some weight is reachable from the outputs without passing through a consumer (a
stage whose output does not depend on its input), or the stage uses activation checkpointing
(each separate call would recompute the checkpointed forward), the split falls back to one
weight pass that re-traverses the graph (still correct, more compute).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["PendingWeightGradients", "backward_input", "backward_weight"]


@dataclasses.dataclass
class PendingWeightGradients:
    """What the weight pass needs: per consumer, its output edges with their gradients and
    its weight-side input edges; or, for the fallback, the outputs and their gradients."""

    consumers: list[tuple[list[GradientEdge], list[torch.Tensor], list[GradientEdge]]]
    weights: list[torch.Tensor]
    fallback: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None


def _graph_nodes(roots: Sequence[Any]) -> list[Any]:
    seen: set[Any] = set()
    order: list[Any] = []
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return order


def _reaching(nodes: list[Any], targets: set[Any]) -> set[Any]:
    """The nodes from which some target is reachable (targets included)."""
    reach: set[Any] = set()
    # `nodes` is in DFS discovery order; iterate to a fixed point (graphs are DAGs, small).
    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):  # children were discovered after parents: few sweeps
            if node in reach:
                continue
            if node in targets or any(n in reach for n, _ in node.next_functions if n is not None):
                reach.add(node)
                changed = True
    return reach


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    split: bool = True,
) -> tuple[list[torch.Tensor], PendingWeightGradients]:
    """Gradients of ``inputs`` now; what :func:`backward_weight` needs for ``weights`` later.

    ``split=False`` keeps the whole graph for one re-traversing weight pass instead; the
    executor asks for it on activation-checkpointed stages, where every separate autograd
    call of the split weight pass would recompute the checkpointed forward again.

    >>> layer = torch.nn.Linear(3, 3)
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> y = layer(x)
    >>> (dx,), pending = backward_input([y], [torch.ones_like(y)], [x], list(layer.parameters()))
    >>> backward_weight(pending)
    >>> layer.bias.grad.tolist()
    [2.0, 2.0, 2.0]
    """
    if not split:
        grads = torch.autograd.grad(
            list(outputs), list(inputs), output_grads, retain_graph=True, allow_unused=True
        )
        fallback = (list(outputs), list(output_grads) if output_grads else None)
        return _fill(grads, inputs), PendingWeightGradients([], list(weights), fallback)
    roots = [t.grad_fn for t in outputs]
    nodes = _graph_nodes(roots)
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    weight_nodes = {get_gradient_edge(w).node for w in weights if w.requires_grad}
    to_input = _reaching(nodes, input_nodes)
    to_weight = _reaching(nodes, weight_nodes)

    consumers: list[tuple[Any, list[GradientEdge]]] = []
    covered: set[Any] = set()
    for node in nodes:
        if node not in to_input:
            continue
        weight_side = [
            GradientEdge(next_node, index)
            for next_node, index in node.next_functions
            if next_node is not None and next_node not in to_input and next_node in to_weight
        ]
        if weight_side:
            consumers.append((node, weight_side))
            covered.update(_reaching(_graph_nodes([e.node for e in weight_side]), weight_nodes))
    reachable_weights = weight_nodes & set(nodes)
    if not reachable_weights <= covered:
        # Some weight is not behind a consumer: compute input grads, keep the whole graph.
        grads = torch.autograd.grad(
            list(outputs), list(inputs), output_grads, retain_graph=True, allow_unused=True
        )
        pending = PendingWeightGradients(
            [], list(weights), (list(outputs), list(output_grads) if output_grads else None)
        )
        return _fill(grads, inputs), pending

    captured: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    handles = [
        node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
        for node, _ in consumers
    ]
    try:
        grads = torch.autograd.grad(
            list(outputs), list(inputs), output_grads, retain_graph=True, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    pending_consumers = []
    for node, weight_side in consumers:
        arriving = captured.get(node)
        if arriving is None:
            continue  # not executed: no gradient reaches it, nothing to do for its weights
        edges = [GradientEdge(node, i) for i, g in enumerate(arriving) if g is not None]
        values = [g for g in arriving if g is not None]
        if edges:
            pending_consumers.append((edges, values, weight_side))
    return _fill(grads, inputs), PendingWeightGradients(pending_consumers, list(weights))


def _fill(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, like)]


def backward_weight(pending: PendingWeightGradients) -> None:
    """Accumulate the weight gradients recorded by :func:`backward_input` into ``.grad``."""
    weights = [w for w in pending.weights if w.requires_grad]
    if not weights:
        return
    if pending.fallback is not None:
        outputs, grads = pending.fallback
        torch.autograd.backward(outputs, grads, inputs=weights)
        return
    for edges, values, weight_side in pending.consumers:
        into_weights = torch.autograd.grad(edges, weight_side, values, retain_graph=True)
        torch.autograd.backward(weight_side, list(into_weights), inputs=weights)
