"""What autograd keeps for backward, measured: one counter, three ways to read it.

Backward needs tensors that forward made; autograd saves them on its graph until the
backward that uses them.  Their bytes are a layer's *saved activations*, the term the
memory model (:mod:`tutorial_lib.costs.memory_model`) predicts.  One mechanism measures them:
:class:`SavedTensorBytes`, a ``torch.autograd.graph.saved_tensors_hooks`` pair whose pack
hook counts the storage behind every saved tensor (each storage once: a saved view keeps
its whole storage; the parameters left out) and hands the tensor back as it is.  Read:

* as one total around any forward (``saved.bytes``): what the pipeline executor counts per
  microbatch and chunk, and chapter 10 per stage;
* per module (:func:`saved_activation_bytes`): a counter entered by each module's forward
  pre-hook and left by its forward hook (chapters 3 and 9, the TP layers' tests);
* per layer (:func:`saved_bytes_by_layer`): one counter around a whole forward, each new
  storage filed under the ``layer_number`` trace tag current when autograd saved it
  (activation recomputation's tests, chapter 10).

Enter a counter outside any checkpointed region: hooks entered *inside* one take
precedence over the checkpoint's own and would keep every tensor there
(:mod:`tutorial_lib.recompute`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable

import torch

from .trace import get_tracer

__all__ = ["SavedTensorBytes", "saved_activation_bytes", "saved_bytes_by_layer"]


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class SavedTensorBytes:
    """Count the bytes autograd saves for backward while the ``with`` block runs.

    ``with SavedTensorBytes(module.parameters()) as saved: forward()``, then ``saved.bytes``:
    the storages of the saved tensors (a saved view keeps its whole storage), each once,
    those of ``exclude`` (the parameters) left out
    (``torch.autograd.graph.saved_tensors_hooks``).  The tensors are kept as they are.
    ``key``: a function of nothing, called when a new storage is counted; its bytes are then
    also added to ``saved.by_key[key()]`` (:func:`saved_bytes_by_layer` files them by layer).
    """

    def __init__(self, exclude=(), key: Callable[[], Hashable] | None = None):
        # by the storage itself, not its address: a ZeRO-3 unit frees its parameters'
        # storage between uses and gathers it again elsewhere (resize_ keeps the storage)
        self.exclude = {p.untyped_storage()._cdata for p in exclude}
        self.seen: set[int] = set()
        self.bytes = 0
        self.key = key
        self.by_key: dict = {}
        self._hooks = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if storage._cdata not in self.exclude and pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes += storage.nbytes()
            if self.key is not None:
                where = self.key()
                self.by_key[where] = self.by_key.get(where, 0) + storage.nbytes()
        return tensor

    def __enter__(self):
        self.seen.clear()  # a storage counts once per block (a later one may reuse the address)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _keep)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False


@contextmanager
def saved_activation_bytes(modules: dict[str, torch.nn.Module]):
    """Measure the bytes autograd keeps for backward inside each module's forward.

    ``with saved_activation_bytes({"qkv": block.self_attention.linear_qkv}) as saved:`` run
    forward, then ``saved["qkv"]`` is the bytes of the tensors that module's autograd
    nodes saved (:class:`SavedTensorBytes`: each storage once, the module's own parameters
    left out): its saved activations.  Summed over every forward inside the ``with`` block
    (each storage once per forward).  Modules must not contain one another.
    """
    saved = {name: 0 for name in modules}
    handles = []

    def watch(name, module):
        counters = []

        def enter(mod, args):
            counters.append(SavedTensorBytes(module.parameters()).__enter__())

        def leave(mod, args, output):
            counter = counters.pop()
            counter.__exit__(None, None, None)
            saved[name] += counter.bytes

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    for name, module in modules.items():
        watch(name, module)
    try:
        yield saved
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def saved_bytes_by_layer(parameters=()):
    """``with saved_bytes_by_layer(model.parameters()) as kept:`` run a forward; then
    ``kept[layer_number]`` is the bytes autograd keeps for backward from that layer
    (``kept[None]``: outside the layers: embedding, head, loss).

    :class:`SavedTensorBytes` (each storage once, the ``parameters`` left out), filed by
    the ``layer_number`` trace tag that :class:`~tutorial_lib.deepseek.DeepSeekModel` sets
    while a layer (or a checkpointed group, for its saved input) runs.  Enter it outside
    any checkpointed region (see the module doc), around a whole forward.
    """
    tracer = get_tracer()
    with SavedTensorBytes(parameters,
                          key=lambda: tracer.current_tags().get("layer_number")) as saved:
        yield saved.by_key
