"""Each chapter's "How long it takes" line states the time measured for it, not a guess.

The times are measured by ``python scripts/time_chapters.py`` (every chapter executed in a
fresh kernel by nbclient, as the book build does) and stored, with the machine, the date
and the load, as the reference ``chapter_times`` (tutorial_lib/reference/chapter_times.json).
A chapter opens with ``**How long it takes.**`` and a duration; it agrees with the stored
time when it is within 25 % of it (or 5 s, for short chapters): "about 40 seconds" for a
stored 37.2 s. A range ("30 to 60 seconds") must contain it, give or take the same
margin; "under a minute" must be above it. Re-measure after changing a chapter, then fix
its sentence. A line that types no duration instead says the time is "read from the stored
reference" (the opening table and the last cell read it), so it cannot disagree with it.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tutorial_lib import reference
from tutorial_lib.chapters import stems
from tests.asserts import every

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
MARK = "**How long it takes.**"
READ_NOT_TYPED = "read from the stored reference"
WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
         "seven": 7, "eight": 8, "nine": 9, "ten": 10, "half a": 0.5}
NUMBER = r"(\d+(?:\.\d+)?|half a|an|a|one|two|three|four|five|six|seven|eight|nine|ten)"
DURATION = re.compile(
    rf"(?P<bound>under|less than|at most)?\s*(?:about|around|roughly|some)?\s*\b{NUMBER}"
    rf"(?:\s*(?:to|-|\u2013)\s*{NUMBER})?\s*(?P<unit>seconds?|s\b|minutes?|min\b)", re.I)


READING = re.compile(r"Reading takes[^.]*\.")
"""The sentence giving the reading time, left out before looking for a run time."""


def value(word: str) -> float:
    word = word.lower()
    return WORDS[word] if word in WORDS else float(word)


def stated_seconds(sentence: str) -> tuple[float, float, bool]:
    """``(low, high, is_upper_bound)`` of the first duration in ``sentence``, in seconds."""
    m = DURATION.search(sentence)
    if m is None:
        raise ValueError(f"no duration in {sentence!r}")
    scale = 60.0 if m.group("unit").lower().startswith("min") else 1.0
    low = value(m.group(2)) * scale
    high = value(m.group(3)) * scale if m.group(3) else low
    return low, high, bool(m.group("bound"))


def agrees(sentence: str, measured: float) -> bool:
    low, high, upper_bound = stated_seconds(sentence)
    if upper_bound:
        return measured <= high
    margin = max(0.25 * measured, 5.0)
    return low - margin <= measured <= high + margin


def how_long_sentence(path: Path) -> str | None:
    """The text after ``**How long it takes.**`` up to the end of its paragraph."""
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown" and MARK in cell.source:
            return cell.source.split(MARK, 1)[1].split("\n\n")[0].strip()
    return None


def chapters() -> list[str]:
    return stems()


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    return {row["chapter"]: row["seconds"] for row in reference.load("chapter_times").rows}


@pytest.mark.parametrize("chapter", chapters())
def test_how_long_it_takes_states_the_measured_time(chapter, measured):
    sentence = how_long_sentence(NOTEBOOKS / f"{chapter}.ipynb")
    assert sentence is not None, (f"{chapter} has no '{MARK}' line: add one stating "
                                  "the time stored by scripts/time_chapters.py")
    assert chapter in measured, f"{chapter} was never timed: python scripts/time_chapters.py {chapter[:2]}"
    sentence = READING.sub("", sentence)  # how long reading takes is not a run time
    if DURATION.search(sentence) is None:
        # No number typed: the line must send the reader to the stored times, which the
        # opening table shows (test_each_chapter_shows_its_own_times_by_section_and_exercise)
        assert READ_NOT_TYPED in " ".join(sentence.split()), (
            f"{chapter}: '{MARK}' states no duration; state the stored time or say that "
            f"{READ_NOT_TYPED!r} ...")
        return
    low, high, _ = stated_seconds(sentence)
    assert agrees(sentence, measured[chapter]), (
        f"{chapter} says {sentence[:80]!r} ({low:g}-{high:g} s) but took "
        f"{measured[chapter]:.0f} s ({reference.load('chapter_times').caption()})")


@pytest.mark.parametrize("sentence,seconds,ok", [
    ("Running all cells takes about 10 seconds on 2 CPU cores", 12.0, True),
    ("Running all cells takes about 10 seconds on 2 CPU cores", 40.0, False),
    ("About 2 minutes on 2 CPU cores.", 130.0, True),
    ("About 2 minutes on 2 CPU cores.", 60.0, False),
    ("It runs in about 30 to 60 seconds.", 65.0, True),
    ("It runs in about 30 to 60 seconds.", 120.0, False),
    ("Under a minute on 2 cores.", 59.0, True),
    ("Under a minute on 2 cores.", 75.0, False),
    ("about half a minute", 31.0, True),
])
def test_the_sentence_reader(sentence, seconds, ok):
    assert agrees(sentence, seconds) is ok


def test_every_chapter_is_stored(measured):
    """The stored reference covers exactly the chapters (none missing, none left over), in
    book order."""
    assert list(measured) == chapters()


@pytest.mark.parametrize("chapter", chapters())
def test_each_chapter_shows_its_own_times_by_section_and_exercise(chapter):
    """Exercises that teach: the chapter opens with its run time per section and per exercise, read
    from the stored reference (reference.chapter_times_table) for this chapter."""
    cells = nbformat.read(NOTEBOOKS / f"{chapter}.ipynb", as_version=4).cells
    shown = [c for c in cells if c.cell_type == "code" and "chapter_times_table(" in c.source]
    assert len(shown) == 1, f"{chapter}: {len(shown)} cells show the chapter's times"
    assert f'chapter_times_table("{chapter}")' in shown[0].source
    first_section = next(i for i, c in enumerate(cells)
                         if c.cell_type == "markdown" and c.source.startswith("## "))
    assert cells.index(shown[0]) < first_section, "the times belong to the chapter's opening"


@pytest.mark.parametrize("chapter", chapters())
def test_the_stored_times_have_every_section_and_exercise_of_the_chapter(chapter):
    """A section or exercise added since the chapter was timed fails here: re-measure."""
    from tutorial_lib import classroom

    nb = nbformat.read(NOTEBOOKS / f"{chapter}.ipynb", as_version=4)
    sections = [c.source.splitlines()[0][3:].strip() for c in nb.cells
                if c.cell_type == "markdown" and c.source.startswith("## ")]
    sections = [title for title in sections if title not in reference.UNTIMED_SECTIONS]
    exercises = [f"Exercise {e.number}" for e in classroom.chapter_exercises(nb)]
    rows = reference.chapter_time_rows(chapter)
    parts = [part for part, _ in rows]
    assert parts[-1] == "the whole chapter"
    assert [p for p in parts if p != "Opening"][:-1] == sections + exercises, (
        f"{chapter} changed since it was timed: python scripts/time_chapters.py {chapter[:2]}")
    assert every(seconds >= 0 for _, seconds in rows)
    whole = rows[-1][1]
    assert sum(seconds for part, seconds in rows[:len(parts) - 1 - len(exercises)]) <= whole
