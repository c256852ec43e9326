"""Which module of the library may import which: CONTRIBUTING's module table, as data.

``MAY_IMPORT[module]``: the modules of ``tutorial_lib`` that ``module`` may import, at
module level or inside a function (a name such as ``"costs"`` allows the package and every
module in it).  ``LAZY_IMPORTS[module]``: what it may import only inside a function, each
with the reason the import waits (a torch-free module that must stay torch-free at import,
a drawing that must not load the modules that talk to processes, a package that loads every
drawing).  A package's ``__init__`` may always import its own modules.

``tests/unit/test_layering.py`` reads every module's imports with ``ast`` and fails on any
import this table does not allow, on a module without a row (a new module must be
registered here) and on a row without a module.  It also checks, through everything a module
loads when it is imported, that no drawing (``viz``) reaches ``torch.distributed`` or
:data:`PROCESS_MODULES`, and that the :data:`TORCH_FREE` modules load no torch.

Module names are relative to ``tutorial_lib``: ``"costs.memory_model"`` is
``tutorial_lib/costs/memory.py``.  Adding a module: add its row (and, when it is torch-free
by promise, its name to :data:`TORCH_FREE`).
"""
from __future__ import annotations

__all__ = ["MAY_IMPORT", "LAZY_IMPORTS", "PROCESS_MODULES", "TORCH_FREE"]

MAY_IMPORT: dict[str, tuple[str, ...]] = {
    # foundations: nothing of ours, or only each other
    "config": (),
    "devices": (),
    "trace": (),
    "recipes": (),
    "source": (),
    "chapters": (),
    "layering": (),
    "grid": ("config",),
    "checkpointing": ("config",),
    "pipeline_parallel": (),
    "pipeline_parallel.actions": ("config",),
    "pipeline_parallel.schedules": ("config", "pipeline_parallel"),
    "pipeline_parallel.zero_bubble": ("config", "pipeline_parallel"),
    "pipeline_parallel.simulator": ("config", "pipeline_parallel"),
    "pipeline_parallel.formulas": ("config", "pipeline_parallel"),
    "pipeline_parallel.modes": ("config", "pipeline_parallel"),
    "recompute": ("config", "trace"),
    "data": ("devices",),
    "reference": (),
    # launching ranks and the live groups
    "parallel_state": ("config", "grid"),
    "launch": ("config", "trace"),
    "cluster": ("launch", "trace"),
    "classroom": ("launch",),
    "comm": ("parallel_state", "trace"),
    "ring_collectives": ("comm", "parallel_state", "trace"),
    # the techniques
    "tensor_parallel": (),
    "tensor_parallel.mappings": ("comm", "parallel_state", "trace"),
    "tensor_parallel.random": ("devices",),
    "tensor_parallel.layers": ("comm", "devices", "parallel_state", "tensor_parallel.mappings",
                               "tensor_parallel.random"),
    "tensor_parallel.cross_entropy": ("comm", "parallel_state", "tensor_parallel.mappings"),
    "saved_activations": ("trace",),
    "context_parallel": ("comm", "config", "parallel_state", "trace"),
    "data_parallel": ("comm", "parallel_state", "trace"),
    "fully_sharded_data_parallel": ("comm", "config", "data_parallel", "parallel_state",
                                    "trace"),
    "fp8_format": ("recipes",),
    "fp8": ("comm", "fp8_format", "parallel_state", "trace"),
    "precision": ("devices", "fp8", "moe", "recipes", "tensor_parallel"),
    "moe_balance": ("comm",),
    "moe": ("comm", "config", "data_parallel", "devices", "fp8", "moe_balance",
            "parallel_state", "tensor_parallel", "trace"),
    "transformer": ("context_parallel", "devices", "parallel_state", "recompute",
                    "tensor_parallel"),
    "p2p": ("comm", "devices", "parallel_state", "pipeline_parallel", "trace"),
    # models, steps and runs
    "gpt": ("config", "devices", "parallel_state", "tensor_parallel", "transformer"),
    "tp_dp_step": ("comm", "data", "data_parallel", "devices", "parallel_state",
                   "tensor_parallel", "trace"),
    "deepseek": ("config", "context_parallel", "devices", "gpt", "moe", "moe_balance",
                 "parallel_state", "recompute", "tensor_parallel", "trace", "transformer"),
    "pipeline_parallel.backward_split": (),
    "pipeline_parallel.executor": ("comm", "deepseek", "devices", "p2p", "parallel_state",
                                   "pipeline_parallel", "saved_activations", "trace"),
    "pipeline_parallel.dualpipe": ("comm", "data_parallel", "parallel_state", "pipeline_parallel",
                                   "trace"),
    "pipeline_parallel.synthetic": ("config", "deepseek", "devices", "moe", "parallel_state",
                                    "pipeline_parallel", "trace"),
    "memory": ("config", "costs.memory_model", "costs.model_flops", "pipeline_parallel",
               "recompute"),
    "arguments": ("checkpointing", "config", "costs.memory_model", "grid", "pipeline_parallel",
                  "recipes", "recompute"),
    "dist_checkpointing": ("checkpointing", "data_parallel", "fully_sharded_data_parallel",
                           "parallel_state"),
    "train_4d": ("arguments", "checkpointing", "comm", "context_parallel", "data",
                 "data_parallel", "deepseek", "devices", "fully_sharded_data_parallel",
                 "launch", "memory", "moe_balance",
                 "parallel_state", "pipeline_parallel", "precision", "tp_dp_step",
                 "trace"),
    # closed-form predictions (no torch at import)
    "costs": (),
    "costs.bandwidth": (),
    "costs.alpha_beta": (),
    "costs.moe": (),
    "costs.cp_messages": ("costs.alpha_beta",),
    "costs.memory_model": ("config", "grid", "pipeline_parallel", "recompute"),
    "costs.tp_dp_step": (),
    "costs.hardware": ("config", "costs.alpha_beta"),
    "costs.model_flops": ("config", "costs.memory_model"),
    "costs.step_time": ("config", "costs.alpha_beta", "costs.hardware", "costs.memory_model",
                        "costs.model_flops", "grid", "pipeline_parallel", "recompute"),
    "costs.rooflines": ("config", "costs.alpha_beta", "costs.hardware", "costs.memory_model",
                        "costs.step_time"),
    "plan": ("config", "costs.hardware", "costs.memory_model", "costs.model_flops",
             "costs.step_time"),
    "published_runs": ("costs.hardware", "costs.model_flops", "costs.step_time", "plan",
                       "reference"),
    "costs.zero_stages": ("config", "costs.alpha_beta", "costs.memory_model", "costs.tp_dp_step"),
    # timing runs on this machine: the only modules below the chapters that launch ranks
    "timing": (),
    "timing.runs": ("launch",),
    "timing.alpha_beta": ("comm", "costs", "timing.runs"),
    "timing.p2p_modes": ("config", "devices", "p2p", "parallel_state", "timing.runs"),
    "timing.fp8_all_to_all": ("config", "devices", "fp8", "parallel_state", "timing.runs",
                              "trace"),
    "timing.cp_attention": ("config", "context_parallel", "devices", "parallel_state",
                            "timing.runs"),
    # drawings: never the modules that talk to processes
    "viz": (),
    "viz.draw": (),
    "viz.widget": (),
    "viz.table": (),
    "viz.collective_animation": ("trace", "viz.draw", "viz.widget"),
    "viz.moe_flow": ("trace", "viz.draw", "viz.widget"),
    "viz.timeline": ("pipeline_parallel", "trace", "viz.draw", "viz.widget"),
    "viz.cp_ring": ("trace", "viz.draw", "viz.widget"),
    "viz.rank_map": ("config", "grid", "viz.draw", "viz.widget"),
    "viz.fp8_tiles": ("fp8_format", "viz.widget"),
    "viz.fp8_legs": ("fp8_format", "viz.draw"),
    "viz.memory_explorer": ("config", "costs.memory_model", "memory", "recompute", "viz.widget"),
    "viz.cheatsheet": ("chapters", "config", "costs", "grid", "pipeline_parallel", "plan",
                       "recipes"),
    "viz.layout_explorer": ("config", "costs", "plan", "viz.draw", "viz.widget"),
    # the exercises: the kit, and the modules each exercise is about
    "exercises": (),
    "exercises.sealed": (),
    "exercises.kit": ("launch",),
    "exercises.ch01": ("exercises.kit", "grid"),
    "exercises.ch02": ("ring_collectives", "comm", "exercises.kit", "launch"),
    "exercises.ch03": ("config", "costs", "data_parallel", "exercises.kit", "launch",
                       "parallel_state", "tensor_parallel", "transformer"),
    "exercises.ch04": ("config", "costs", "exercises.kit", "launch", "moe", "moe_balance",
                       "parallel_state"),
    "exercises.ch05": ("exercises.kit", "moe", "moe_balance"),
    "exercises.ch06": ("deepseek", "exercises.kit", "pipeline_parallel"),
    "exercises.ch07": ("comm", "exercises.kit", "launch", "p2p", "parallel_state", "timing"),
    "exercises.ch08": ("exercises.kit", "fp8", "precision"),
    "exercises.ch09": ("context_parallel", "costs", "exercises.kit", "timing"),
    "exercises.ch10": ("config", "costs.memory_model", "exercises.kit", "memory", "recompute"),
    "exercises.ch11": ("exercises.kit", "pipeline_parallel"),
    "exercises.ch12": ("costs.memory_model", "exercises.kit"),
    "exercises.ch13": ("config", "costs.hardware", "costs.model_flops", "costs.step_time",
                       "exercises.kit", "plan"),
}

LAZY_IMPORTS: dict[str, dict[str, str]] = {
    "launch": {
        "parallel_state": "only inside a rank, with torch's collective check on: the "
                          "launcher loads no torch in the notebook's process",
    },
    "cluster": {
        "comm": "only inside a rank, for the namespace of its cells: the notebook's process "
                "loads no torch to start a cluster",
    },
    "classroom": {
        "exercises.sealed": "the sealed check runs only when the grader grades: writing a "
                            "handout or an nbgrader source loads no checker",
    },
    "reference": {
        "chapters": "the manifest names a chapter's stored times only when a chapter's table "
                    "is read: measuring scripts save references without it",
        "viz.table": "only when a table of stored timings is drawn: importing viz loads every "
                     "drawing, and reference is read by scripts that draw nothing",
    },
    "memory": {
        "arguments": "the command line's defaults are the 4D run's own (TrainingArgs), read "
                     "when it runs: the memory model sits below the run's arguments",
    },
    "costs.tp_dp_step": {
        "transformer": "with TP > 1 a block's collectives come from the block's own "
                       "accounting (block_collectives); at module level costs would load torch",
    },
    "context_parallel": {
        "tensor_parallel": "the all_gather mode borrows TP's sequence gather (its backward the "
                           "reduce-scatter of dK/dV), only where that mode runs",
        "moe": "the a2a mode (Ulysses) borrows the MoE layer's uneven all-to-all and its "
               "autograd reverse, only where that mode runs",
    },
    "train_4d": {
        "dist_checkpointing": "torch.distributed.checkpoint (DTensor, the device mesh) loads "
                              "only in a run that saves or loads a checkpoint",
    },
    "viz.cp_ring": {
        "context_parallel": "the ring's own chunk ids, read when a ring is drawn: "
                            "context_parallel talks to processes, and no drawing loads "
                            "torch.distributed at import",
    },
    "viz.cheatsheet": {
        "moe_balance": "chapter 5's key table computes a balance loss with the library's "
                       "function when the sheets are built; it talks to processes, which no "
                       "drawing loads at import",
        "fp8_format": "chapter 8's key table reads the wire bytes per row when the sheets "
                      "are built: building the other sheets loads no torch",
    },
}

PROCESS_MODULES: tuple[str, ...] = ("comm", "parallel_state", "launch", "cluster")
"""The modules that start ranks or talk between them: no drawing loads them at import."""

TORCH_FREE: tuple[str, ...] = (
    "config", "grid", "recipes", "checkpointing", "recompute",
    "pipeline_parallel", "pipeline_parallel.actions", "pipeline_parallel.schedules",
    "pipeline_parallel.zero_bubble", "pipeline_parallel.simulator", "pipeline_parallel.formulas",
    "pipeline_parallel.modes",
    "memory", "arguments", "layering",
    "costs", "costs.bandwidth", "costs.alpha_beta", "costs.moe", "costs.cp_messages",
    "costs.memory_model", "costs.tp_dp_step", "costs.zero_stages", "costs.hardware",
    "costs.model_flops",
    "costs.step_time", "costs.rooflines", "plan", "published_runs",
)
"""Modules that promise to load no torch when imported (a command line checks its
arguments before torch loads; the cost model runs where torch is not installed)."""
