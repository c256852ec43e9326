"""The README's test command must collect every test folder and every chapter."""
import subprocess
import sys

import pytest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def collected_files(request) -> set[str]:
    """The files the README's command (`python -m pytest`, no argument) collects.

    Inside that very command this session's own items are the answer; a run given paths
    or options of its own (say `pytest tests/dist`) asks a fresh `pytest --collect-only`.
    """
    config = request.config
    plain = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if plain and not (config.option.keyword or config.option.markexpr
                      or config.option.deselect):
        return {item.nodeid.split("::")[0] for item in request.session.items}
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=REPO,
                             capture_output=True, text=True, timeout=120).stdout
    return {line.split("::")[0] for line in listing.splitlines() if "::" in line}


def test_plain_pytest_collects_the_multiprocess_tests_and_every_notebook(request):
    # pytest's default norecursedirs contains "dist": without pyproject's own list the
    # real multi-process tests in tests/dist would be skipped without a word.
    collected = collected_files(request)
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    notebooks = {str(p.relative_to(REPO)) for p in (REPO / "notebooks").glob("*.ipynb")}
    assert any(path.startswith("tests/dist/") for path in collected)
    assert on_disk - collected == set(), f"test files pytest does not collect: {on_disk - collected}"
    assert notebooks - collected == set(), f"notebooks nbval does not collect: {notebooks - collected}"
