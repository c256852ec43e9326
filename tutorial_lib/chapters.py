"""The chapters of the course, in book order: one entry per chapter, read by every list.

A chapter is more than its notebook: a checkers module for its exercises, a key table on
its cheat sheet, stored timings it shows beside the reader's, and the functions the device
test runs from it.  Each of those lists reads :data:`CHAPTERS` instead of keeping its own
copy, so a new chapter is registered here once (CONTRIBUTING.md, "Adding a chapter").
``_toc.yml`` stays the book's own table of contents; ``tests/unit/test_chapters.py``
checks that it lists these notebooks in this order, and that ``notebooks/`` holds no
chapter missing here.

    from tutorial_lib.chapters import CHAPTERS, chapter
    chapter(3).notebook          # '03_tp_dp.ipynb'
    chapter("03_tp_dp").title    # 'Tensor parallel + data parallel'

Pure data: nothing here imports torch or another module of the library.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
"""The chapters' folder in a checkout of the course."""


@dataclass(frozen=True)
class Chapter:
    """One chapter and everything registered for it."""

    number: int
    notebook: str
    """Its file name in ``notebooks/``: ``NN_name.ipynb``, ``NN`` its number."""
    title: str
    """Its title, as its first cell's heading spells it (``# N. Title``)."""
    checkers: str | None
    """The module of ``tutorial_lib.exercises`` that checks its exercises (``ch03``)."""
    key_table: str
    """The function of :mod:`tutorial_lib.viz.cheatsheet` that computes its cheat sheet's
    key table."""
    references: tuple[str, ...] = ()
    """The stored timings it shows (``tutorial_lib/reference/<name>.json``), besides its
    run time per section in the reference ``chapter_times`` that every chapter has."""
    device_runs: tuple[str, ...] = ()
    """What ``tests/dist/test_device.py`` runs from it under a strict default device: the
    labels of its jobs, without the chapter's number (its notebook functions, and the
    library's timing workers it launches)."""

    @property
    def stem(self) -> str:
        """The notebook's name without ``.ipynb``: the key of its stored run time."""
        return self.notebook.removesuffix(".ipynb")

    @property
    def key(self) -> str:
        """Its number in two digits, as its notebook's name starts (``"03"``)."""
        return f"{self.number:02d}"

    @property
    def path(self) -> Path:
        return NOTEBOOKS / self.notebook

    @property
    def checkers_module(self) -> str | None:
        """The checkers' importable name (``tutorial_lib.exercises.ch03``)."""
        return None if self.checkers is None else f"tutorial_lib.exercises.{self.checkers}"


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(1, "01_communicator_groups.ipynb", "Communicator groups and rank mapping",
            "ch01", "_groups_table",
            device_runs=("live_groups megatron", "live_groups course")),
    Chapter(2, "02_collectives.ipynb", "Collectives, live", "ch02", "_collectives_table",
            references=("ch02_alpha_beta",),
            device_runs=("tp_mlp", "matched_pair", "measure_alpha_beta's worker",
                         "all_reduce_demo", "reduce_scatter_demo", "all_gather_demo",
                         "broadcast_demo", "moe_dispatch_demo", "pipeline_demo",
                         "ring_demo")),
    Chapter(3, "03_tp_dp.ipynb", "Tensor parallel + data parallel", "ch03", "_zero_table",
            references=("ch03_overlap",),
            device_runs=("column_parallel_demo", "row_parallel_demo", "block_demo",
                         "block_demo SP", "loss_demo", "tp_dp_mlp_demo", "step_demo")),
    Chapter(4, "04_moe_ep.ipynb", "DeepSeekMoE with expert parallelism", "ch04",
            "_moe_table", references=(),
            device_runs=("dispatch_demo", "dedup_demo", "sequence_parallel_demo", "one_step",
                         "read_domains", "gradient_demo")),
    Chapter(5, "05_moe_aux_losses.ipynb", "DeepSeekMoE auxiliary losses", "ch05",
            "_losses_table", references=("ch04_ch05_runtime",),
            device_runs=("split_over_tp", "train")),
    Chapter(6, "06_pipeline_4d.ipynb", "Pipeline parallelism in the 4D grid", "ch06",
            "_bubble_table", references=("ch06_bubble",),
            device_runs=("measure_synthetic_schedules", "live_groups TP2 x PP2 x DP2",
                         "live_groups PP2 x EP2 x DP4")),
    Chapter(7, "07_p2p_modes.ipynb", "Pipeline P2P: three ways to exchange a message",
            "ch07", "_modes_table", references=("ch07_p2p_modes",),
            device_runs=("round_with_the_guides_peer", "one_round_per_mode",
                         "measure_p2p_modes' worker")),
    Chapter(8, "08_fp8_communication.ipynb", "FP8 communication on the expert-parallel path",
            "ch08", "_wire_table", references=("ch08_fp8_all_to_all",),
            device_runs=("moe_in_every_precision", "time_all_to_all's worker")),
    Chapter(9, "09_context_parallel.ipynb", "Context parallelism: one sequence, many ranks",
            "ch09", "_cp_table", references=("ch09_cp_modes", "ch09_ring_work"),
            device_runs=("kept_per_rank", "measure_ring_work's worker",
                         "measure_cp_modes' worker")),
    # chapter 10 launches only train_4d, whose runs the device test makes on its own
    Chapter(10, "10_memory.ipynb", "Memory: where the bytes of a rank go", "ch10",
            "_memory_table"),
    Chapter(11, "11_zero_bubble_dualpipe.ipynb", "Zero-bubble schedules and DualPipe",
            "ch11", "_zero_bubble_table",
            device_runs=("measure_synthetic_schedules",
                         "measure_synthetic_schedules, PP2 x EP2")),
    Chapter(12, "12_sharded_data_parallel.ipynb",
            "Sharded data parallelism: ZeRO-2, ZeRO-3 and FSDP", "ch12", "_sharding_table",
            device_runs=("all_stages", "tp_or_zero3, TP 4")),
    # chapter 13 launches no ranks: the planner is pure arithmetic (its check against this
    # machine's train_4d runs is a stored reference, bench/bench_planner_cpu.py)
    Chapter(13, "13_choosing_a_layout.ipynb", "Choosing a layout", "ch13", "_layout_table",
            references=("ch13_planner_cpu",)),
)
"""Every chapter, in book order."""


def chapter(which: int | str) -> Chapter:
    """The chapter numbered ``which`` (``3``), or whose notebook is ``which`` (``"03_tp_dp"``,
    with or without ``.ipynb``) or starts with it (``"03"``)."""
    for entry in CHAPTERS:
        if which in (entry.number, entry.stem, entry.notebook, entry.key):
            return entry
    known = ", ".join(f"{c.number} ({c.stem})" for c in CHAPTERS)
    raise KeyError(f"no chapter {which!r} in tutorial_lib.chapters.CHAPTERS: the chapters "
                   f"are {known}; a new one is added there first (CONTRIBUTING.md, "
                   f"'Adding a chapter')")


def unregistered_notebooks(folder: Path = NOTEBOOKS) -> list[str]:
    """The chapter notebooks of ``folder`` (named ``NN_name.ipynb``) that no entry of
    :data:`CHAPTERS` lists: a chapter written but not registered."""
    listed = {entry.notebook for entry in CHAPTERS}
    return sorted(path.name for path in Path(folder).glob("[0-9][0-9]_*.ipynb")
                  if path.name not in listed)


def notebook_paths() -> list[Path]:
    """Every chapter's notebook, in book order."""
    return [entry.path for entry in CHAPTERS]


def stems() -> list[str]:
    """Every chapter's notebook name without ``.ipynb``, in book order."""
    return [entry.stem for entry in CHAPTERS]


__all__ = ["CHAPTERS", "Chapter", "NOTEBOOKS", "chapter", "notebook_paths", "stems",
           "unregistered_notebooks"]
