"""The backward in two parts, B (the input's gradient) and W (the weights'), on autograd.

**B and W** (chapter 11).  A schedule that splits a backward runs B, the gradient of the
stage's input (what the previous stage waits for), and later W, the weights' gradients
(what nobody waits for): :func:`backward_input` and :func:`backward_weight`, the same
autograd nodes on the same tensors as one backward, so the same gradients bit for bit.
The executor (:mod:`~tutorial_lib.pipeline_parallel.executor`) runs B and W where a
chapter-11 schedule (:mod:`~tutorial_lib.pipeline_parallel.zero_bubble`) splits a
backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

def _grad_node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or for a leaf
    its gradient accumulator (made on demand, through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reaching(parents: dict, targets) -> set:
    """The nodes from which one of ``targets`` is reached in the backward graph."""
    found, todo = set(targets), list(targets)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


@dataclass
class WeightGradWork:
    """What B leaves for W: where the weight gradients leave the input gradient's path.

    ``junctions``: for every node on the path from the stage's output to its input that
    also feeds a weight, the gradient it received in B and the edges towards the weights
    (``(node, grad_outputs, edges)``).  ``output`` / ``output_grad``: the stage's output
    and its gradient, for a stage without an input gradient (the first), whose whole
    backward is W.
    """

    junctions: list = field(default_factory=list)
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None,
                   stage_input: torch.Tensor | None) -> tuple:
    """B: the gradient of the stage's input only; returns ``(input_grad, work for W)``.

    Autograd runs from ``output`` (with ``output_grad``; ``None`` for a scalar loss) to
    ``stage_input`` alone, so it visits only the nodes on that path (the MoE all-to-alls
    included) and skips every weight gradient; the graph is kept.  A hook on each
    *junction* (a node of that path with an edge towards a weight) records the gradient
    that reached it, where :func:`backward_weight` starts later.  The same split as
    ``torch.distributed.pipelining``'s ``stage_backward_input`` /
    ``stage_backward_weight`` (torch 2.13.0, ``torch/distributed/pipelining/_backward.py``),
    with two differences: W re-runs each junction for its weight-side outputs only (one
    junction at a time, so a junction below another is not counted twice), and W's last
    pass runs through the parameters' gradient accumulators, so gradient hooks fire as in
    a plain backward (:class:`~tutorial_lib.data_parallel.DataParallel`'s ``main_grad``
    buckets, ZeRO-1's fp32 accumulation).  With no ``stage_input`` (the first model
    stage: nothing to send back) B does nothing and W is the whole backward, as in torch's
    ``PipelineStage.backward_one_chunk``.
    """
    if stage_input is None:
        return None, WeightGradWork(output=output, output_grad=output_grad)
    root, target = output.grad_fn, _grad_node(stage_input)
    parents: dict = {}  # the backward graph reversed: node -> the nodes with an edge to it
    seen, todo = {root}, [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    on_path = _reaching(parents, [target])
    accumulators = [n for n in seen if not n.next_functions and n is not target
                    and type(n).__name__ == "AccumulateGrad"]
    feeds_weight = _reaching(parents, accumulators)
    junctions = []
    for node in on_path:
        edges = [(child, nr) for child, nr in node.next_functions
                 if child is not None and child not in on_path and child in feeds_weight]
        if edges:
            junctions.append([node, None, edges])
    handles = []
    for junction in junctions:
        def record(grad_outputs, junction=junction):
            junction[1] = grad_outputs
        handles.append(junction[0].register_prehook(record))
    try:
        (input_grad,) = torch.autograd.grad(output, stage_input, output_grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, WeightGradWork([j for j in junctions if j[1] is not None])


def backward_weight(work: WeightGradWork) -> None:
    """W: the weight gradients B deferred, accumulated into ``.grad`` (hooks fire).

    For each junction: its gradients towards the weights, from the gradient it received
    in B; then one backward from all those edges into the parameters.
    """
    from torch.autograd.graph import GradientEdge

    if work.output is not None:  # the first stage: the whole backward
        torch.autograd.backward(work.output, work.output_grad)
        return
    roots, grads = [], []
    for node, grad_outputs, edges in work.junctions:
        outputs = [GradientEdge(node, k) for k, g in enumerate(grad_outputs) if g is not None]
        seeds = [g for g in grad_outputs if g is not None]
        targets = [GradientEdge(child, nr) for child, nr in edges]
        found = torch.autograd.grad(outputs, targets, seeds, retain_graph=True,
                                    allow_unused=True)
        roots += [t for t, g in zip(targets, found) if g is not None]
        grads += [g for g in found if g is not None]
    if roots:
        torch.autograd.backward(roots, grads)
