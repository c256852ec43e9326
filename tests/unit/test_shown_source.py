"""Every ``show_source(...)`` a chapter calls resolves, without running the chapter.

A chapter shows the library's real code; if a shown object is renamed or an excerpt's
``start`` / ``end`` anchor disappears from the source, the chapter breaks.  This test
finds every call in every notebook, resolves its target through the notebook's own
import lines, and cuts the excerpt exactly as the chapter would.
"""
import ast
import json
from pathlib import Path

import pytest

from tutorial_lib.source import show_source

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def imports_of(path) -> dict:
    """The namespace the notebook's import statements build (and nothing else of it)."""
    namespace = {}
    for source in code_cells(path):
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell with IPython syntax imports nothing we show
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace


def shown(path) -> list[ast.Call]:
    calls = []
    for source in code_cells(path):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        calls += [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and getattr(n.func, "id", None) == "show_source"]
    return calls


CALLS = [(path, call) for path in NOTEBOOKS for call in shown(path)]


def test_the_chapters_show_code():
    assert len(CALLS) >= 50, len(CALLS)  # every chapter shows its library


@pytest.mark.parametrize("path,call", CALLS, ids=[f"{p.stem}:{ast.unparse(c)[:70]}" for p, c in CALLS])
def test_every_shown_target_and_anchor_resolves(path, call):
    namespace = imports_of(path)
    target = eval(compile(ast.Expression(call.args[0]), str(path), "eval"), namespace)
    anchors = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert not any(part.startswith("_") for part in ast.unparse(call.args[0]).split(".")), \
        f"{ast.unparse(call)}: a chapter shows only public names"
    show_source(target, **anchors)  # raises ValueError when an anchor is missing


def test_a_missing_anchor_is_caught():
    with pytest.raises(ValueError, match="does not occur"):
        show_source(show_source, start="this line is not in the source")
