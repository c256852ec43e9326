"""Stored reference measurements: saved with their machine, date and load, loaded back."""
import pytest

from tutorial_lib import reference


def test_save_then_load_keeps_rows_and_says_where_they_were_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    rows = [{"bytes": 4, "us": 120.5}, {"bytes": 1 << 20, "us": 900.0}]
    saved = reference.save("demo_table", rows, command="python bench/x.py", notes="gloo")
    back = reference.load("demo_table")
    assert back.rows == rows and back.column("bytes") == [4, 1 << 20]
    assert back.machine == saved.machine and "cores" in back.machine
    assert back.command == "python bench/x.py" and back.notes == "gloo"
    assert back.caption().startswith(f"reference: {back.machine}, {back.date}")


def test_unknown_and_odd_names_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    reference.save("known_one", [])
    with pytest.raises(FileNotFoundError, match="no stored reference 'missing'.*known_one"):
        reference.load("missing")
    with pytest.raises(ValueError, match="plain file stem"):
        reference.load("../etc/passwd")


def test_the_load_taken_before_measuring_is_the_one_stored(tmp_path, monkeypatch):
    """A measuring script's own processes raise the load average it would read after the
    run; the load it took before is what ``Reference.load`` means."""
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    assert reference.save("before", [], load=0.3).load == 0.3
    assert reference.load("before").load == 0.3


def test_measure_references_runs_the_references_not_stored_yet():
    """``scripts/measure_references.py`` reads each stored reference's command; one whose
    measuring script exists but which no idle machine has stored yet is run too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "measure_references.py"
    spec = importlib.util.spec_from_file_location("measure_references", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.NOT_YET_MEASURED == {}  # every reference a chapter reads is stored
    script.NOT_YET_MEASURED["ch99_new"] = "python bench/bench_new.py --save"
    plan = script.commands(["ch02_alpha_beta", "ch99_new"])
    assert plan["python bench/bench_alpha_beta.py --save"] == ["ch02_alpha_beta"]
    assert plan["python bench/bench_new.py --save"] == ["ch99_new"]


def test_every_stored_reference_was_measured_on_an_idle_machine():
    """The chapters show these numbers as what the machine does when nothing else runs: a
    reference taken at a one-minute load of 1 or more (or with no load recorded) is refused.
    ``python scripts/measure_references.py`` measures them again, each after waiting for
    the load to fall under 0.5."""
    names = sorted(path.stem for path in reference.REFERENCE_DIR.glob("*.json"))
    assert len(names) >= 10, names  # chapters 2 to 9 and 13, and the chapter times
    busy = {name: reference.load(name).load for name in names
            if reference.load(name).load is None or reference.load(name).load >= 1}
    assert not busy, (f"references measured on a busy machine (name: load): {busy}; "
                      "measure them again with python scripts/measure_references.py NAME")


def test_a_chapters_last_cell_states_the_opening_tables_whole_chapter_time():
    """One source for a chapter's stored run time: the line its last cell prints reads the
    same row as the opening table's last one, and every line fits the page column."""
    whole = reference.chapter_time_rows("03_tp_dp")[-1]
    line = reference.chapter_time_here("03_tp_dp", 12.4)
    assert whole[0] == "the whole chapter"
    assert "this notebook ran in 12 s here" in line
    assert f"the whole chapter took {whole[1]:.0f} s" in line
    assert reference.load("chapter_times").caption() in line
    assert max(map(len, line.split("\n"))) <= 88
