"""Pipeline parallelism: schedules as data, their simulator and formulas, and the executor.

One module per concern, each read beside its chapter:

=====================  =======  ==========================================================
module                 chapter  what it holds
=====================  =======  ==========================================================
``actions``            6, 11    :class:`~.actions.Action`, its kinds, the schedules' names,
                                where stages live (``model_stage``), the argument checks,
                                one compute with its messages (the building blocks)
``schedules``          6        GPipe, 1F1B, interleaved 1F1B (Megatron's schedule table)
``zero_bubble``        11       ZB-H1, ZBV, DualPipeV, DualPipe (B and W apart)
``simulator``          6, 11    every rank's list played at once: times, deadlocks
``formulas``           6, 10,   the bubble, the activations in flight, the DualPipe table
                       11
``modes``              7        P2P modes, (schedule, mode) rules, Megatron's helper calls
``executor``           6        the executor: one rank's list run with real stages
``backward_split``     11       B and W on autograd
``dualpipe``           11       overlapped pairs taking turns, the two model copies' sums
``synthetic``          6, 11    a stage with a known cost; measuring schedules
=====================  =======  ==========================================================

The first six import no torch: a chapter, a widget or ``train_4d``'s argument check reads
a schedule without loading it.  This package's ``__init__`` holds only the schedules by
name (:data:`BUILDERS`, :func:`build_schedules`), which need both builder modules.
"""
from __future__ import annotations

from .actions import ALL_SCHEDULES, Action, check_pipeline
from .schedules import gpipe, interleaved_one_f_one_b, one_f_one_b
from .zero_bubble import dualpipe, dualpipev, zb_h1, zbv

BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zbv": zbv,
            "dualpipev": dualpipev, "dualpipe": dualpipe}
"""Each one-rank builder by schedule name (the interleaved one takes ``V`` too)."""


def build_schedules(name: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1,
                    **options) -> dict[int, list[Action]]:
    """Every rank's list: ``build_schedules("1f1b", 4, 8)`` -> ``{0: [...], ..., 3: [...]}``.

    ``name`` is one of :data:`ALL_SCHEDULES`.  ``options`` go to the schedule's builder:
    ``wrong_recv_backward_peer`` for ``1f1b``, ``microbatch_group_size_per_vp_stage``
    for ``interleaved``.  The V-shaped and DualPipe schedules fix their own chunks
    (two per rank); ``virtual_pipeline_size`` is for ``interleaved`` only.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    if name != "interleaved" and virtual_pipeline_size != 1:
        raise ValueError(f"virtual_pipeline_size ({virtual_pipeline_size}) needs the interleaved "
                         f"schedule, not {name!r}")
    check_pipeline(pp_size, num_microbatches, 0, virtual_pipeline_size,
                   options.get("microbatch_group_size_per_vp_stage") if name == "interleaved" else None)
    if name == "interleaved":
        return {r: interleaved_one_f_one_b(pp_size, num_microbatches, r, virtual_pipeline_size, **options)
                for r in range(pp_size)}
    build = BUILDERS[name]
    return {r: build(pp_size, num_microbatches, r, **options) for r in range(pp_size)}

