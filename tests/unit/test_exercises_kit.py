"""The exercise kit: named mistakes pick the hint, a stub wins, answers are read however they
are spelled, and a launcher's deadlock report is read back (no process is started here: the
checkers that launch workers are tested in tests/dist)."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib.exercises import kit
from tutorial_lib.exercises.kit import Case, Checking, Mistakes

TABLE = Mistakes("generic", any_case={"format"}, format="F", a="A", b="B", also_a="A")


@pytest.mark.parametrize("failing,hint", [
    ([], "generic"),                          # nothing judged: the generic hint
    ([{"a"}, {"a", "b"}], "A"),               # the first mistake every failing case shows
    ([{"b"}, {"a", "b"}], "B"),
    ([{"a"}, {"b"}], "generic"),              # no mistake explains every case
    ([{"a"}, set()], "generic"),              # a case no named mistake explains
    ([{"a"}, {"format"}], "F"),               # an any-case mistake: one case is enough
])
def test_mistakes_pick_the_first_that_explains_the_failures(failing, hint):
    assert TABLE.hint(failing) == hint
    assert TABLE.hint(failing, generic="other") == ("other" if hint == "generic" else hint)


def test_a_table_knows_its_names_and_refuses_an_unknown_any_case():
    assert [m.name for m in TABLE] == ["format", "a", "b", "also_a"]
    assert "b" in TABLE and TABLE.hint_of("also_a") == "A"
    assert all(m.any_case for m in Mistakes("g", any_case=True, x="X", y="Y"))
    with pytest.raises(ValueError, match="no hint"):
        Mistakes("g", any_case={"typo"}, x="X")


def test_a_stub_wins_over_every_mistake():
    check = Checking("Exercise 0.1: demo", TABLE)
    case, got = check.run("first", lambda: 1, 2)
    check.shows({"a"})
    check.run("second", lambda: (_ for _ in ()).throw(NotImplementedError()), 2)
    result = check.verdict()
    assert check.stub and result.hint == kit.STUB_HINT
    assert case.detail == "got 1, expected 2" and "NotImplementedError" in result.cases[1].detail


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
    assert result.hint == "two: why"
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
    """Issue 13: in the built book every checker runs on the unfilled stub, and its box read
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
