"""Show the library's real source in a chapter, so the book can never drift from the code."""
from __future__ import annotations

import inspect
import textwrap


def show_source(obj, start: str | None = None, end: str | None = None):
    """Syntax-highlighted source of a function, class or module, as it is on disk.

    ``start``/``end`` cut an excerpt: from the first line containing ``start`` up to
    and including the first following line containing ``end``.
    """
    from IPython.display import Markdown

    lines = inspect.getsource(obj).splitlines()
    if start is not None:
        first = next((i for i, ln in enumerate(lines) if start in ln), None)
        if first is None:
            raise ValueError(f"{start!r} does not occur in the source of {obj!r}")
        lines = lines[first:]
    if end is not None:
        last = next((i for i, ln in enumerate(lines) if end in ln), None)
        if last is None:
            raise ValueError(f"{end!r} does not occur in the selected source of {obj!r}")
        lines = lines[: last + 1]
    module = inspect.getmodule(obj)
    where = module.__name__ if module else "?"
    header = f"# from {where}" + (f" ({obj.__qualname__})" if hasattr(obj, "__qualname__") else "")
    body = header + "\n" + textwrap.dedent("\n".join(lines))
    # Markdown, so the built book highlights it with the same theme as its own code cells.
    return Markdown(f"````python\n{body}\n````")
