"""Where tensors live: the one rule every module follows, and two helpers.

Every tensor the library makes is created on an explicit device: the device of the
tensors it works on (``torch.zeros(n, device=x.device)``), or the ``device`` a model, a
stage or a layer was built for.  Nothing relies on torch's default device, so the same
code runs on the CPU over gloo and on one GPU per rank over NCCL (``ctx.device``, set by
:mod:`tutorial_lib.launch`).  A module built with ``device=None`` follows torch's own
convention for its layers: torch's default device (the CPU unless changed); the chapters
and the 4D run always pass ``ctx.device``.

Random initial weights are drawn on the CPU, from a seeded CPU generator, and then copied
to the device: a GPU's generator gives other numbers than the CPU's, and every layout and
every device must hold the very same model.

``tests/dist/test_device.py`` checks the rule: it runs every chapter's worker functions
and the 4D run with torch's default device set to ``meta`` inside every worker (the
launcher's ``TUTORIAL_LIB_DEFAULT_DEVICE``) while the code is told ``device="cpu"``; a
tensor created without an explicit device lands on ``meta`` and the run fails.
"""
from __future__ import annotations

import torch

__all__ = ["resolve_device", "module_device", "cpu_generator", "synchronize"]


def resolve_device(device=None) -> torch.device:
    """``device`` as a ``torch.device``; ``None``: torch's default device, as torch's
    own layers read it."""
    return torch.get_default_device() if device is None else torch.device(device)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (a module of several devices
    is not something this library builds)."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    raise ValueError(f"{type(module).__name__} holds no parameter or buffer, so it has no "
                     f"device; pass the device explicitly")


def synchronize(device) -> None:
    """Wait until ``device`` has run everything queued on it (nothing to wait for on the
    CPU): a host timer read after this measures the GPU's work, not just its queueing."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: initial weights and data are drawn with it on
    the CPU, then moved, so every device gets the same numbers."""
    return torch.Generator(device="cpu").manual_seed(seed)
