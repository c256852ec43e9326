"""Every package the install resolves is pinned, theme packages included.

Once only jupyter-book was pinned, so the theme pair it pulls in (sphinx-book-theme,
pydata-sphinx-theme) could change at the next install, and the pair installed then drew a
second, hidden set of sidebar toggles that left the visible ones dead on phones.
constraints.txt pins the whole closure (written by scripts/lock_requirements.py from what is
installed), and requirements.txt reads it, so the README's install uses it.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lock_module():
    spec = importlib.util.spec_from_file_location("lock_requirements",
                                                  ROOT / "scripts" / "lock_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    from packaging.utils import canonicalize_name

    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-reader.txt"])
def test_the_install_reads_the_constraints(name):
    lines = [l.strip() for l in (ROOT / name).read_text().splitlines()]
    assert "-c constraints.txt" in lines
    for line in lines:  # every direct requirement is exact
        if line and not line.startswith(("#", "-")):
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.+]*", line), line


def test_every_resolved_package_is_pinned_at_its_installed_version():
    lock = lock_module()
    from packaging.utils import canonicalize_name

    resolved = lock.resolve(lock.top_level_requirements() + lock.project_requirements())
    pinned = pins()
    for theme in ("sphinx-book-theme", "pydata-sphinx-theme", "sphinx", "myst-nb",
                  "myst-parser", "sphinx-togglebutton", "docutils"):
        assert theme in pinned, f"{theme} is not pinned"
    missing = sorted(n for n in resolved if canonicalize_name(n) not in pinned)
    assert not missing, f"resolved but not pinned: {missing}: python scripts/lock_requirements.py"
    wrong = {n: (v, pinned[canonicalize_name(n)]) for n, v in resolved.items()
             if re.sub(r"\+.*", "", v) != pinned[canonicalize_name(n)]}
    assert not wrong, f"installed != pinned: {wrong}: python scripts/lock_requirements.py"


def test_torch_stays_the_release_the_course_is_tested_with():
    assert pins()["torch"] == "2.13.0"
