"""The memory explorer: every pipeline rank's memory for a grid of layouts, played in the page.

    memory_explorer()           # the presets of tutorial_lib.memory, TP x PP x EP x ZeRO 0-3 x recompute

The reader picks a preset (DeepSeek-V3 and Llama 3.1 405B, their published shapes, at
thousands of GPUs; the layers split over the pipeline ranks as
:func:`~tutorial_lib.memory.preset_stage_layers` says), the TP, PP and EP sizes (DP is what
the world leaves), the data-parallel sharding strategy (plain DP, ZeRO-1, ZeRO-2 or
ZeRO-3: Megatron-FSDP's four), a recomputation setting and a memory budget per GPU.  The
widget draws one stacked bar per pipeline rank: weights, ZeRO-3's gathered parameters at
the peak, gradients, optimizer state, activations at the schedule's peak, and the budget
as a line.  Every number was computed in Python by
:func:`tutorial_lib.costs.memory_per_rank` when the widget was built (:func:`explorer_data`);
the page only picks and draws them, so it works in the static book without a kernel.
"""
from __future__ import annotations

import html
import itertools

from ..config import SHARDING_STRATEGIES, ConfigError
from ..memory import PRESETS, preset_ranks
from ..recompute import Recompute
from .widget import Explorer

__all__ = ["explorer_data", "MemoryExplorer", "memory_explorer", "GRID", "ZERO_LABELS",
           "BUDGETS_GIB", "MIB"]

MIB = 2**20
GRID = {"tp": (1, 2, 4, 8), "pp": (1, 4, 8, 16), "ep": (1, 8, 64), "zero": (0, 1, 2, 3),
        "recompute": ("none", "selective", "full")}
"""The settings the explorer offers (EP only where the preset has experts); ``zero`` is the
stage of the data-parallel sharding strategy: ``SHARDING_STRATEGIES[zero]``."""
ZERO_LABELS = ("plain DP", "ZeRO-1 (optim)", "ZeRO-2 (optim_grads)",
               "ZeRO-3 (optim_grads_params)")
"""The buttons of the four stages (Megatron-FSDP's strategy names)."""
BUDGETS_GIB = (40, 80, 141)
"""Memory per GPU to compare with: 40 and 80 GiB (A100 / H100 sizes), 141 (H200)."""
RECOMPUTE = {"none": Recompute(), "selective": Recompute("selective"),
             "full": Recompute("full", "uniform", 1)}


def explorer_data(presets=("deepseek-v3", "llama-3.1-405b")) -> dict:
    """Everything the widget draws: per preset and setting, each pipeline rank's
    ``[weights, gathered, gradients, optimizer, activations]`` in MiB (rounded up), or why the
    layout is refused."""
    errors: list[str] = []
    out = {"presets": [], "grid": {k: list(v) for k, v in GRID.items()},
           "budgets": list(BUDGETS_GIB), "zero_labels": list(ZERO_LABELS),
           "parts": ["weights", "gathered", "gradients", "optimizer", "activations"],
           "results": {}, "errors": errors}
    for name in presets:
        preset = PRESETS[name]
        eps = GRID["ep"] if preset.model.num_experts else (1,)
        out["presets"].append({"name": name, "note": preset.note, "world": preset.layout["world_size"],
                               "ep": list(eps), "precision": preset.precision})
        for tp, pp, ep, zero, rc in itertools.product(GRID["tp"], GRID["pp"], eps, GRID["zero"],
                                                      GRID["recompute"]):
            key = f"{name}|{tp}|{pp}|{ep}|{zero}|{rc}"
            try:
                ranks = preset_ranks(preset, tp, pp, ep,
                                     data_parallel_sharding_strategy=SHARDING_STRATEGIES[zero],
                                     recompute=RECOMPUTE[rc])
            except (ConfigError, ValueError) as err:
                message = str(err)
                if message not in errors:
                    errors.append(message)
                out["results"][key] = {"error": errors.index(message)}
                continue
            dp = preset.layout["world_size"] // (tp * pp)  # preset_layout's, which just passed
            out["results"][key] = {"dp": dp, "m": preset.global_batch_size // dp,
                                   "ranks": [[-(-v // MIB) for v in (r.weights, r.gathered, r.gradients,
                                                                      r.optimizer, r.activations)]
                                             for r in ranks]}
    return out


class MemoryExplorer(Explorer):
    """The widget: ``data`` is :func:`explorer_data`'s; ``to_html()``, ``_repr_html_()``, ``save()``."""

    styles = Explorer.styles + ("memory.css",)
    scripts = ("memory.js",)
    start = "startMemoryExplorer"
    id_prefix = "tl-mem-"
    data_class = "tl-mem-data"
    default_title = "Memory per pipeline rank: pick a layout"

    def parts(self, uid: str) -> tuple[str, str, object]:
        rows = "".join(f'<div class="tl-mem-row"><span class="tl-mem-label">{label}</span>'
                       f'<span class="tl-mem-{key} tl-mem-row"></span></div>'
                       for key, label in (("preset", "model"), ("tp", "TP"), ("pp", "PP"),
                                          ("ep", "EP"), ("zero", "optimizer"),
                                          ("recompute", "recompute"), ("budget", "GPU memory")))
        markup = (f'<div class="tl-mem-title">{html.escape(self.title)}</div>{rows}'
                  f'<div class="tl-mem-summary"></div>'
                  f'<svg width="720" height="200" role="img" '
                  f'aria-label="memory of each pipeline rank"></svg>'
                  f'<div class="tl-mem-legend"></div>')
        attributes = f'class="tl-memory-explorer" id="{uid}" data-key="" data-fits=""'
        return attributes, markup, self.data


def memory_explorer(presets=("deepseek-v3", "llama-3.1-405b"), title: str = "") -> MemoryExplorer:
    """The explorer over :data:`GRID` for ``presets`` (names in :data:`tutorial_lib.memory.PRESETS`)."""
    return MemoryExplorer(explorer_data(presets), title)
