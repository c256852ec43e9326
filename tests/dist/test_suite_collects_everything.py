"""The README's test command must collect every test folder and every chapter."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_plain_pytest_collects_the_multiprocess_tests_and_every_notebook():
    # pytest's default norecursedirs contains "dist": without pyproject's own list the
    # real multi-process tests in tests/dist would be skipped without a word.
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=REPO,
                             capture_output=True, text=True, timeout=120).stdout
    collected = {line.split("::")[0] for line in listing.splitlines() if "::" in line}
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    notebooks = {str(p.relative_to(REPO)) for p in (REPO / "notebooks").glob("*.ipynb")}
    assert any(path.startswith("tests/dist/") for path in collected)
    assert on_disk - collected == set(), f"test files pytest does not collect: {on_disk - collected}"
    assert notebooks - collected == set(), f"notebooks nbval does not collect: {notebooks - collected}"
