"""The layering table (``tutorial_lib.layering``) holds for every module of the library.

Every ``import`` of ``tutorial_lib`` is read from the source with ``ast``, at module level
and inside functions (a lazy import), and checked against the table: a module may import
what its row lists (at any level) and, inside functions only, what its lazy row lists with
a reason.  A module missing from the table fails, and so does a row for a module that no
longer exists.  The drawings (``viz``) and the torch-free modules are also checked through
everything they load at import time.
"""
import ast
import functools
from pathlib import Path

import pytest

from tutorial_lib import layering

ROOT = Path(layering.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py")) if module_name(p)}


def _resolve(base: list[str], names) -> list[str]:
    """``from <base> import names``: each name that is one of our modules, else the base."""
    out = []
    for alias in names:
        full = ".".join(base + [alias.name])
        if full in MODULES:
            out.append(full)
        elif ".".join(base) in MODULES:
            out.append(".".join(base))
    return out


@functools.lru_cache(maxsize=None)
def imports_of(name: str) -> tuple[tuple[str, bool, int], ...]:
    """``(module of ours, lazy, line)`` for every import in ``name``'s source; external
    modules come back as ``"ext:<name>"``."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - child.level + 1]
                    base += child.module.split(".") if child.module else []
                elif (child.module or "").split(".")[0] == "tutorial_lib":
                    base = child.module.split(".")[1:]
                else:
                    found.append((f"ext:{child.module}", inner, child.lineno))
                    continue
                found.extend((m, inner, child.lineno) for m in _resolve(base, child.names))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "tutorial_lib":
                        found.append((alias.name.split(".", 1)[1], inner, child.lineno))
                    else:
                        found.append((f"ext:{alias.name}", inner, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return tuple(found)


def _covered(target: str, allowed) -> bool:
    """``target`` is listed, or lies in a listed package."""
    return any(target == a or target.startswith(a + ".") for a in allowed)


def violations(name: str) -> list[str]:
    own_package = name if MODULES[name].name == "__init__.py" else None
    allowed = layering.MAY_IMPORT[name]
    lazy = layering.LAZY_IMPORTS.get(name, {})
    out = []
    for target, is_lazy, line in imports_of(name):
        if target.startswith("ext:") or target == name:
            continue
        if own_package and target.startswith(own_package + "."):
            continue  # a package's __init__ gathers its own modules
        if _covered(target, allowed) or (is_lazy and target in lazy):
            continue
        how = "inside a function" if is_lazy else "at module level"
        out.append(f"tutorial_lib/{MODULES[name].relative_to(ROOT)}:{line} imports {target} "
                   f"{how}; {name}'s row allows {sorted(allowed) or 'nothing of ours'}"
                   + (f" (lazily: {sorted(lazy)})" if lazy else ""))
    return out


def loaded_at_import(name: str) -> set[str]:
    """Every module our ``name`` loads when imported (its module-level imports, theirs,
    and the ``__init__`` of each package on the way), ``ext:`` ones included."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages above
        if current.startswith("ext:"):
            continue
        todo += [t for t, is_lazy, _ in imports_of(current) if not is_lazy]
    return seen


def test_every_module_has_a_row_and_every_row_a_module():
    missing = sorted(set(MODULES) - set(layering.MAY_IMPORT))
    assert not missing, (f"modules missing from tutorial_lib/layering.py's MAY_IMPORT: {missing}; "
                         f"add a row (what each may import) for every new module")
    stale = sorted(set(layering.MAY_IMPORT) - set(MODULES))
    assert not stale, f"rows of MAY_IMPORT for modules that do not exist: {stale}"


def test_the_table_names_only_our_modules_and_gives_every_lazy_import_a_reason():
    for name, allowed in layering.MAY_IMPORT.items():
        unknown = [a for a in allowed if a not in MODULES]
        assert not unknown, f"{name}'s row lists {unknown}, not modules of tutorial_lib"
    for name, lazy in layering.LAZY_IMPORTS.items():
        assert name in MODULES, name
        for target, reason in lazy.items():
            assert target in MODULES, (name, target)
            assert len(reason.split()) >= 5, f"{name} -> {target}: give the reason in words"
            assert not _covered(target, layering.MAY_IMPORT[name]), \
                f"{name} -> {target} is allowed at module level already: drop its lazy row"


@pytest.mark.parametrize("name", sorted(set(MODULES) & set(layering.MAY_IMPORT)))
def test_imports_follow_the_table(name):
    assert not violations(name), "\n".join(violations(name))


def test_a_violation_is_caught(monkeypatch):
    """The check itself can fail: an import the row leaves out, at either level."""
    assert _covered("costs.memory", ("costs",)) and not _covered("costs", ("costs.memory",))
    assert not violations("train_4d")
    monkeypatch.setitem(layering.LAZY_IMPORTS, "train_4d", {})
    assert any("imports dist_checkpointing inside a function" in v for v in violations("train_4d"))
    row = tuple(m for m in layering.MAY_IMPORT["fp8"] if m != "comm")
    monkeypatch.setitem(layering.MAY_IMPORT, "fp8", row)
    assert any("imports comm at module level" in v for v in violations("fp8"))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n == "viz" or n.startswith("viz.")))
def test_no_drawing_loads_torch_distributed(name):
    loaded = loaded_at_import(name)
    talking = sorted(m for m in loaded if m.startswith("ext:torch.distributed")
                     or m in layering.PROCESS_MODULES)
    assert not talking, f"importing tutorial_lib.{name} loads {talking}"


@pytest.mark.parametrize("name", layering.TORCH_FREE)
def test_torch_free_modules_load_no_torch(name):
    torch = sorted(m for m in loaded_at_import(name) if m.split(".")[0] == "ext:torch")
    assert not torch, f"importing tutorial_lib.{name} loads {torch}"
