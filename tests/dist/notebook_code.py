"""A chapter's own definitions, read from its notebook, to run its worker functions in a test.

:func:`chapter_namespace` executes, from every code cell of a chapter, only the top-level
statements that define something: imports, functions, classes and assignments (an
assignment that starts a launch, a measurement or a widget is left out, and one that
fails because it reads a result the chapter computed is skipped).  The functions the
chapter hands to ``launch`` are then the chapter's very code, with its constants; a test
may replace a constant (smaller sizes) before it ships the functions to the workers.
Nothing here starts a process.
"""
import ast
import re

import nbformat

# calls that start processes, time something, draw or make a folder: never executed here
# (a chapter removes its temporary folder in a later cell that is no definition)
_SKIPPED_CALLS = re.compile(r"^(launch|train|measure_\w+|time_\w+|warm_up|Cluster|run|mkdtemp|"
                            r"grid_cli|subplots|show_source|animate_\w+|table|timeline|rank_map|"
                            r"serial_layer_error|forward_stage)$")


def _called_names(node):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            yield func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _kept(statement) -> bool:
    if isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
        return True
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):
        return not any(_SKIPPED_CALLS.match(name) for name in _called_names(statement))
    return False


def chapter_namespace(path, module_name: str) -> dict:
    """The definitions of the notebook at ``path``, executed in a fresh namespace named
    ``module_name`` (not importable, so cloudpickle ships its functions by value)."""
    namespace = {"__name__": module_name}
    notebook = nbformat.read(str(path), as_version=4)
    for cell in notebook.cells:
        if (cell.cell_type != "code" or "install-course" in cell.metadata.get("tags", [])
                or cell.source.lstrip().startswith("%%")):  # a cell magic: not Python
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                           for line in cell.source.splitlines())
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for statement in tree.body:
            if not _kept(statement):
                continue
            code = compile(ast.Module(body=[statement], type_ignores=[]), str(path), "exec")
            try:
                exec(code, namespace)  # noqa: S102 - the course's own notebook
            except Exception:  # noqa: BLE001 - reads a result of a launch left out above
                continue
    return namespace

