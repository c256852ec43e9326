"""The exercise kit: named mistakes pick the hint, a stub wins, answers are read however they
are spelled, and a launcher's deadlock report is read back (no process is started here: the
checkers that launch workers are tested in tests/dist)."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib.exercises import kit
from tutorial_lib.exercises.kit import Case, Checking, Mistakes
from tests.asserts import every

TABLE = Mistakes("generic", any_case={"format"}, format="F", a="A", b="B", also_a="A")


@pytest.mark.parametrize("failing,hint", [
    ([], "generic"),                          # nothing judged: the generic hint
    ([{"a"}, {"a", "b"}], "A"),               # the first mistake every failing case shows
    ([{"b"}, {"a", "b"}], "B"),
    ([{"a"}, {"b"}], "generic"),              # no mistake explains every case
    ([{"a"}, set()], "generic"),              # a case no named mistake explains
    ([{"a"}, {"format"}], "F\nA"),            # an any-case mistake: one case is enough;
                                              # the other cases still get theirs
    ([{"a", "format"}, {"a"}], "A"),          # one mistake explains every case: it alone
])
def test_mistakes_pick_the_first_that_explains_the_failures(failing, hint):
    assert TABLE.hint(failing) == hint
    assert TABLE.hint(failing, generic="other") == ("other" if hint == "generic" else hint)


def test_a_table_knows_its_names_and_refuses_an_unknown_any_case():
    assert [m.name for m in TABLE] == ["format", "a", "b", "also_a"]
    assert "b" in TABLE and TABLE.hint_of("also_a") == "A"
    assert every(m.any_case for m in Mistakes("g", any_case=True, x="X", y="Y"))
    with pytest.raises(ValueError, match="no hint"):
        Mistakes("g", any_case={"typo"}, x="X")


def test_a_stub_wins_over_every_mistake():
    check = Checking("Exercise 0.1: demo", TABLE)
    case, got = check.run("first", lambda: 1, 2)
    check.shows({"a"})
    check.run("second", lambda: (_ for _ in ()).throw(NotImplementedError()), 2)
    result = check.verdict()
    assert check.stub and result.hint == kit.STUB_HINT
    assert case.detail == "got 1, which is not the reference's answer"  # never the expected 2
    assert "NotImplementedError" in result.cases[1].detail


def test_a_checker_that_passes_gets_no_hint_and_an_exception_is_a_case():
    check = Checking("Exercise 0.2: demo", TABLE)
    check.run("right", lambda: 2, 2)
    assert check.verdict().passed and check.result.hint == ""
    check.run("raises", lambda: 1 / 0, 2)
    assert "raised ZeroDivisionError" in check.cases[-1].detail
    assert check.verdict().hint == "generic"


def test_judge_records_what_a_failing_case_shows():
    check = Checking("Exercise 0.3: demo", TABLE)
    cases = [check.run(name, answer, 2) for name, answer in
             [("right", lambda: 2), ("raises", lambda: 1 / 0), ("text", lambda: "x"), ("a", lambda: 3)]]
    for case, got in cases:
        check.judge(case, got, kit.as_number, lambda number: {"a"} if number == 3 else set())
    assert check.failing == [set(), {"format"}, {"a"}]
    check.failing.clear()
    for case, got in cases:
        check.judge(case, got, kit.as_number, lambda number: {"a"}, unreadable="b", exceptions=False)
    assert check.failing == [{"b"}, {"a"}]


def test_check_answers_reads_a_dict_of_situations():
    def judge(name, answer):
        return None if answer == "right" else (f"got {answer!r}", None if answer is None else "why")

    names = ["one", "two", "three"]
    assert kit.check_answers("demo", lambda: dict.fromkeys(names, "right"), names, judge, "FORMAT")
    result = kit.check_answers("demo", lambda: {"one": "right", "two": "wrong"}, names, judge, "FORMAT")
    assert [c.passed for c in result.cases] == [True, False, False]
    assert result.cases[2] == Case("three", False, "missing from the dict")
    assert result.hint == "two: why\nFORMAT"  # every wrong answer's hint, not only the first
    assert result.hints == ["two: why", "FORMAT"] and str(result).count("Hint:") == 2
    assert kit.check_answers("demo", lambda: {"two": None}, names, judge, "FORMAT").hint == "FORMAT"
    assert kit.check_answers("demo", lambda: [1], names, judge, "FORMAT").hint == "FORMAT"


def test_deadlock_kinds_from_reports():
    recv = "waiting in recv from rank 1 on world group [0, 1]"
    send = "waiting in send to rank 1 on world group [0, 1]"
    assert kit.deadlock_kind({0: recv, 1: recv}) == "all_recv"
    assert kit.deadlock_kind({0: send, 1: send}) == "all_send"
    assert kit.deadlock_kind({0: "finished", 1: recv}) == "unmatched"
    done = "finished its function; waiting for the other ranks to finish theirs (for 2.0 s)"
    assert kit.deadlock_kind({0: done, 1: send}) == "unmatched"
    assert kit.deadlock_kind({0: send, 1: recv}) == "deadlock"


def test_a_deadlock_summary_keeps_what_each_rank_waited_for():
    report = {1: "finished its function; waiting for the other ranks to finish theirs (for 2.0 s)",
              0: "waiting in recv from rank 2 on pp group [0, 1, 2] shape (6,) (for 3.0 s); stack: f <- g"}
    assert kit.deadlock_summary(report) == ("rank 0: waiting in recv from rank 2; "
                                            "rank 1: finished its function")
    assert kit.WAITING_IN.search(report[0]).groups() == ("recv from", "2")


@pytest.mark.parametrize("value,number", [(3, 3.0), ("2.5", 2.5), (torch.tensor(4.0), 4.0),
                                          (True, None), ("lots", None), (float("nan"), None), (None, None)])
def test_as_number(value, number):
    assert kit.as_number(value) == number


def test_is_close_reads_the_number_first():
    assert kit.is_close("1536", 1536.0) and kit.is_close(1536 + 1e-7, 1536.0, abs_tol=1e-6)
    assert not kit.is_close("lots", 1.0) and not kit.is_close(1.1, 1.0)


@pytest.mark.parametrize("value,numbers", [
    ([1, 2.0, 0], [1, 2, 0]), ((3,), [3]), (torch.tensor([2, 0]), [2, 0]),
    (torch.tensor([1.0, 2.0]), [1, 2]), ([1.5, 2], None), (torch.zeros(2, 2), None),
    (torch.tensor([0.5]), None), ("1,2", None), (3, None), ({"a": 1}, None)])
def test_as_whole_numbers(value, numbers):
    assert kit.as_whole_numbers(value) == numbers


@pytest.mark.parametrize("value,ranks", [([3, 1], [1, 3]), ((2,), [2]), ({5, 4}, [4, 5]),
                                         ("0,2", None), ({0: 2}, None), (7, None), ([object()], None)])
def test_as_rank_list(value, ranks):
    assert kit.as_rank_list(value) == ranks


@pytest.mark.parametrize("value,kinds", [
    ("dp", {"dp"}), ("tp+dp", {"tp", "dp"}), (["TP", " dp"], {"tp", "dp"}), (None, set()),
    ("none", set()), (set(), set()), ([1, 2], None), (3, None)])
def test_as_group_kinds(value, kinds):
    assert kit.as_group_kinds(value) == (None if kinds is None else frozenset(kinds))


def test_an_unfinished_exercise_reads_as_an_invitation_not_an_error():
    """Found reading the book: in the built book every checker runs on the unfilled stub, and its box read
    "NOT YET ..." in orange monospace, like a failure. The HTML now says whose turn it is,
    what to do, and keeps the failing cases and the hint; the text form is unchanged."""
    result = kit.CheckResult("Exercise 9.9: f", [Case("n=2", False, "the stub still raises "
                                                 "NotImplementedError: fill in its body"),
                                                 Case("n=3", True)], hint=kit.STUB_HINT)
    page = result._repr_html_()
    assert 'data-passed="false"' in page and "Your turn: Exercise 9.9: f" in page
    assert "1 of 2 cases pass so far" in page and "NotImplementedError" in page
    assert "<b>Hint:</b> replace the `raise NotImplementedError` line" in page
    assert "NOT YET" not in page and "#b35900" not in page and "#b42318" not in page
    assert str(result).startswith("NOT YET Exercise 9.9: f: 1/2 cases pass.")

    done = kit.CheckResult("Exercise 9.9: f", [Case("n=2", True)])._repr_html_()
    assert 'data-passed="true"' in done and "Passed: Exercise 9.9: f" in done
    escaped = kit.CheckResult("x", [Case("<a>", False, "b")])._repr_html_()
    assert "<code>&lt;a&gt;</code>: b" in escaped


# --- exercises that teach: staged hints, every hint, no answer key, nbgrader --------------------------------


def test_a_hint_in_stages_gives_the_next_stage_when_the_same_case_fails_again():
    """Exercises that teach: a first failure gets a nudge, a repeated failure of the same case a more
    specific hint; the kernel keeps count, a passing case starts over."""
    table = Mistakes(("nudge", "specific", "more"), a=("A1", "A2"))

    def run(value, name="case"):
        check = Checking("Exercise 0.4: demo", table)
        case, got = check.run(name, lambda: value, 2)
        if not case.passed:
            check.shows({"a"} if value == 3 else set())
        return check.verdict().hint

    assert [run(1), run(1), run(1), run(1)] == ["nudge", "specific", "more", "more"]
    assert run(2) == "" and run(1) == "nudge"      # solved, then wrong again: from the start
    assert run(3) == "A2"                          # the case failed before: the next stage
    assert run(1, "another case") == "nudge"       # another case: its own count
    kit.forget_attempts()
    assert run(1) == "nudge"


def test_check_answers_stages_each_situation_by_its_own_failures():
    def judge(name, answer):
        return None if answer == "right" else ("wrong", ("first why", "second why"))

    names = ["one", "two"]
    first = kit.check_answers("Exercise 0.5: demo", lambda: {"one": "x", "two": "right"}, names,
                              judge, "FORMAT")
    assert first.hint == "one: first why"
    again = kit.check_answers("Exercise 0.5: demo", lambda: {"one": "x", "two": "x"}, names,
                              judge, "FORMAT")
    assert again.hints == ["one: second why", "two: first why"]


def test_a_failing_case_never_shows_the_expected_value():
    check = Checking("Exercise 0.6: demo")
    case, _ = check.run("case", lambda: 41, 424242)
    assert not case.passed and "424242" not in case.detail and "41" in case.detail
    assert "424242" not in str(check.verdict())


def test_a_comparison_that_cannot_read_the_answer_fails_the_case_instead_of_raising():
    case, got = kit.run_case("case", lambda: object(), [1], compare=lambda g, w: list(g) == w)
    assert not case.passed


def test_under_nbgrader_a_check_that_did_not_pass_raises(monkeypatch, capsys):
    """Exercises that teach: nbgrader runs the notebook with NBGRADER_EXECUTION set; a check cell must
    then fail (an autograded test cell scores only when it does not raise), while in the
    book and in a plain notebook it only shows its verdict."""
    check = Checking("Exercise 0.7: demo")
    check.run("case", lambda: 1, 2)
    assert not check.verdict().passed  # no nbgrader: the verdict comes back
    monkeypatch.setenv(kit.GRADING_ENVIRONMENT, "autograde")
    check = Checking("Exercise 0.7: demo")
    check.run("case", lambda: 1, 2)
    with pytest.raises(kit.ExerciseNotPassed, match="NOT YET Exercise 0.7") as raised:
        check.verdict()
    assert isinstance(raised.value, AssertionError) and not raised.value.result.passed
    passing = Checking("Exercise 0.7: demo")
    passing.run("case", lambda: 2, 2)
    assert passing.verdict() is None  # never raises; printed: nbgrader reads a value as points
    assert "PASS Exercise 0.7" in capsys.readouterr().out
    with pytest.raises(kit.ExerciseNotPassed):
        kit.check_answers("Exercise 0.8: demo", lambda: None, ["a"], lambda n, a: None, "FORMAT")


def test_a_result_is_plain_data_for_a_grader():
    result = kit.CheckResult("Exercise 9.9: f", [Case("n=2", False, "wrong")], hint="a\nb")
    assert result.to_dict() == {"exercise": "Exercise 9.9: f", "passed": False, "hint": "a\nb",
                                "cases": [{"name": "n=2", "passed": False, "detail": "wrong"}]}
    assert "<b>Hint:</b> a" in result._repr_html_() and "<b>Hint:</b> b" in result._repr_html_()


# --- a verdict that depends on a timeout is retried once ------------------------------------------


@pytest.mark.parametrize("failure", [kit.LaunchTimeout(2.0, {0: "waiting in recv from rank 1"}),
                                     kit.StartupTimeout(2.0, {0: "not started"})],
                         ids=["deadlock_or_busy", "ranks_not_started"])
def test_a_launch_that_times_out_runs_once_more_with_the_longer_limit(monkeypatch, failure):
    """Every launch of a checker (the student's code on ranks, the checker's own measuring
    run) goes through kit.launch_retrying: a timeout is tried again at four times the
    limit, the second timeout is raised, and any other error is raised at once.  (The
    launcher is replaced by a recorder here: what is tested is the retry, not the ranks;
    tests/dist runs the checkers' real deadlocks and a right answer beside a CPU hog.)"""
    limits = []

    def times_out_then(outcome):
        def fake_launch(worker, world_size, *, args, timeout, print_output):
            limits.append(timeout)
            if len(limits) == 1 or outcome is None:
                raise failure
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return fake_launch

    monkeypatch.setattr(kit, "launch", times_out_then("result"))
    assert kit.launch_retrying(print, 2, timeout=2.0) == "result"
    assert limits == [2.0, 2.0 * kit.RETRY_TIMEOUT_FACTOR] == [2.0, 8.0]

    limits.clear()
    monkeypatch.setattr(kit, "launch", times_out_then(None))
    with pytest.raises(type(failure)):
        kit.launch_retrying(print, 2, timeout=2.0)
    assert limits == [2.0, 8.0]

    limits.clear()  # an error that is no timeout: the student's, not the machine's
    monkeypatch.setattr(kit, "launch", lambda *a, timeout, **k: limits.append(timeout) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        kit.launch_retrying(print, 2, timeout=2.0)
    assert limits == [2.0]

    limits.clear()  # no retry when the factor is 0
    monkeypatch.setattr(kit, "RETRY_TIMEOUT_FACTOR", 0)
    monkeypatch.setattr(kit, "launch", times_out_then("result"))
    with pytest.raises(type(failure)):
        kit.launch_retrying(print, 2, timeout=2.0)
    assert limits == [2.0]


def test_every_launch_of_the_checkers_goes_through_the_retry():
    """No checker module calls the launcher itself: each launch retries (the measuring runs of
    2.2, 2.4, 3.3 and 4.3 would otherwise fail a student's verdict on a busy machine)."""
    import importlib
    import inspect
    import pkgutil

    from tutorial_lib import exercises
    names = [m.name for m in pkgutil.iter_modules(exercises.__path__) if m.name != "kit"]
    assert "ch02" in names and "ch04" in names
    for name in names:
        module = importlib.import_module(f"tutorial_lib.exercises.{name}")
        source = inspect.getsource(module)
        assert "launch(" not in source.replace("launch_retrying(", ""), name
        assert not hasattr(module, "launch"), name
