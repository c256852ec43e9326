"""Widgets of the course: self-contained HTML that works live and in the static book.

* :mod:`.rank_map`: ranks on nodes x GPUs, coloured by communicator group;
* :mod:`.collective_animation`: step-by-step players of recorded collectives;
* :mod:`.timeline`: per-rank timelines of compute spans and communication;
* :mod:`.moe_flow`: tokens moving between expert-parallel ranks, from recorded splits;
* :mod:`.fp8_tiles`: one FP8 tile's values, scale and error;
* :mod:`.cp_ring`: the ring of context-parallel attention, step by step, from its trace;
* :mod:`.memory_explorer`: the memory explorer, every pipeline rank's memory for a grid of layouts;
* :mod:`.table`: a plain HTML table for chapter cells.
* :mod:`.cheatsheet`: each chapter's key table and its one-page cheat sheet, a standalone
  page for slides (``scripts/cheat_sheets.py`` writes them at the book build).

What they share: :mod:`.widget` (the base class :class:`Widget`, every fragment's
layout, the frame player :class:`Animation`, and :func:`live_or_static`, which builds a
kernel-only widget where a kernel runs and a static stand-in for the built book),
:mod:`.draw` (colours and SVG primitives) and ``assets/`` (the JavaScript and CSS,
inlined into each fragment).

The functions named like their modules (``timeline``, ``table``) are imported from
the modules themselves, e.g. ``from tutorial_lib.viz.timeline import timeline``:
re-exporting them here would shadow the modules.
"""
from .collective_animation import animate_collective, animate_ring, animate_ring_all_reduce
from .draw import KIND_COLORS, PALETTE, group_color, kind_color
from .moe_flow import animate_token_flow, dispatch_matrix
from .rank_map import RankMap, rank_map, rank_map_explorer
from .timeline import Timeline, bubble_fraction, busy_fraction, overlap_fraction, overlap_seconds
from .widget import Animation, Note, Widget, in_live_kernel, live_or_static

__all__ = ["Widget", "Animation", "Note", "in_live_kernel", "live_or_static", "animate_collective", "animate_ring", "animate_ring_all_reduce",
           "KIND_COLORS", "PALETTE", "group_color", "kind_color",
           "animate_token_flow", "dispatch_matrix", "RankMap", "rank_map", "rank_map_explorer",
           "Timeline", "bubble_fraction", "busy_fraction", "overlap_fraction", "overlap_seconds"]
