"""The book build: a notebook cell that raises must fail it; a clean book must pass.

These call the real ``scripts/build_book.sh`` (with the real ``_config.yml``) on a tiny
book in ``tmp_path``, so the flags and settings cannot drift from what the project
uses. Each build takes a few seconds.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def notebook(*sources: str) -> str:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# A chapter"}]
    cells += [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
               "source": src} for src in sources]
    return json.dumps({
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    })


def copy_book_setup(book: Path) -> None:
    """The real _config.yml and what it names: the local extension, the template, the
    static files (favicon, vendored scripts), the bibliography file."""
    for name in BOOK_SETUP_FILES:
        shutil.copy(REPO / name, book / name)
    for folder in BOOK_SETUP:
        shutil.copytree(REPO / folder, book / folder)


BOOK_SETUP = ("_ext", "_templates", "_static")
"""The folders _config.yml needs."""
BOOK_SETUP_FILES = ("_config.yml", "references.bib")
"""The files: without references.bib sphinxcontrib-bibtex warns, and -W fails the build."""


def tiny_book(root: Path, *cell_sources: str) -> Path:
    """A book with the real _config.yml, an intro page and one notebook."""
    book = root / "book"
    (book / "notebooks").mkdir(parents=True)
    copy_book_setup(book)
    (book / "_toc.yml").write_text(
        "format: jb-book\nroot: intro\nchapters:\n  - file: notebooks/chapter\n")
    (book / "intro.md").write_text("# Tiny book\n\nSee {doc}`notebooks/chapter`.\n")
    (book / "notebooks" / "chapter.ipynb").write_text(notebook(*cell_sources))
    return book


TINY_REPOSITORY = "https://github.com/course-org/dist-llm"
"""The repository address the tiny book's ``_config.yml`` is given (``tiny_book_html``)."""

WIDGET_NOTEBOOK = {
    "cells": [
        # Math on the same page loads MathJax 3, whose missing MathJax 2 `Hub` used to make
        # every widget with a description throw (_static/mathjax2-shim.js fixes that).
        {"cell_type": "markdown", "metadata": {}, "source": "# Widgets offline\n\n$2(N-1)/N$"},
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
         "source": "import ipywidgets as w\n"
                   "w.VBox([w.IntSlider(value=3, min=0, max=10, description='ranks'),\n"
                   "        w.Button(description='go', icon='play'),\n"
                   "        w.Dropdown(options=['gloo', 'nccl'], value='gloo', description='backend')])"},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}
"""A chapter whose saved ipywidgets state the built page must render from _static alone."""


def set_repository(book: Path, url: str) -> None:
    """Give a book's copy of the real ``_config.yml`` a repository address."""
    config = book / "_config.yml"
    text = config.read_text()
    assert '  url: ""' in text  # the one place the address lives
    config.write_text(text.replace('  url: ""', f'  url: "{url}"', 1))


def test_cell_that_raises_fails_the_build(tmp_path, build_book):
    book = tiny_book(tmp_path, "x = 1", "raise ValueError('boom: this cell is broken')",
                     "print('never reached')")
    result = build_book(book, timeout=120)
    assert result.returncode != 0, "build exited 0 although a cell raised:\n" + result.stdout[-3000:]
    assert "boom: this cell is broken" in result.stdout  # the log shows the cell's error
    assert "HTML:" not in result.stdout  # the script stopped at the failed build


def test_clean_book_builds(tmp_path, build_book):
    book = tiny_book(tmp_path, "import sys\nprint('stderr is fine', file=sys.stderr)",
                     "print(6 * 7)")
    # a folded solution and a folded helper cell, for the labels below
    nb = json.loads((book / "notebooks" / "chapter.ipynb").read_text())
    nb["cells"] += [{"cell_type": "code", "metadata": {"tags": tags}, "execution_count": None,
                     "outputs": [], "source": source}
                    for tags, source in ((["solution", "hide-cell"], "answer = 42"),
                                         (["hide-cell"], "helper = 1"))]
    (book / "notebooks" / "chapter.ipynb").write_text(json.dumps(nb))
    out = tmp_path / "out"
    result = build_book(book, "--path-output", str(out), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    page = out / "_build" / "html" / "notebooks" / "chapter.html"
    assert page.is_file()
    text = page.read_text()
    assert "42" in text  # executed at build time, output in the page
    assert f"HTML: {out.resolve()}/_build/html/index.html" in result.stdout
    # _ext/course_book.py: the solution is labelled as one, the helper cell is not
    assert text.count("Show solution") == 1 and text.count("Show code cell content") == 1
    # no page carries thebe's script, Font Awesome's script or (without math) MathJax
    for name in ("chapter.html", "../intro.html"):
        html = (page.parent / name).read_text()
        assert "THEBE_JS_URL" not in html and "fontawesome.js" not in html
        assert "vendor/mathjax" not in html and 'rel="icon" href=' in html


def test_warning_fails_the_build(tmp_path, build_book):
    """-W: a chapter listed in _toc.yml without its file fails instead of vanishing."""
    book = tiny_book(tmp_path, "print(1)")
    toc = book / "_toc.yml"
    toc.write_text(toc.read_text() + "  - file: notebooks/not_written_yet\n")
    result = build_book(book, timeout=120)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "not_written_yet" in result.stdout


# --- static checks of the real book (no build) --------------------------------------------


def test_toc_entry_has_a_source_file(toc_docname):
    """Each file named in _toc.yml exists (the parametrization comes from conftest.py)."""
    found = [ext for ext in (".md", ".ipynb") if (REPO / f"{toc_docname}{ext}").is_file()]
    assert found, f"_toc.yml lists {toc_docname!r} but there is no {toc_docname}.md/.ipynb"


def test_config_keeps_the_safety_settings():
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    execute = config["execute"]
    assert execute["execute_notebooks"] == "force"  # `cache` misses library changes
    assert execute["raise_on_error"] is True        # else a raising cell exits 0
    assert config["only_build_toc_files"] is True
    assert config["launch_buttons"]["thebe"] is False


def test_config_leaves_out_thebe_and_the_second_header():
    """sphinx-thebe put `const THEBE_JS_URL` on every page twice (a page error on
    every page) although thebe is off; pydata-sphinx-theme 0.17 drew a hidden header whose
    toggle buttons took the handlers meant for the visible ones (dead menus on phones)."""
    sphinx = yaml.safe_load((REPO / "_config.yml").read_text())["sphinx"]
    extensions = sphinx["config"]["extensions"]
    assert "sphinx_thebe" not in extensions and "course_book" in extensions
    assert sphinx["local_extensions"] == {"course_book": "_ext"}
    assert sphinx["config"]["html_theme_options"]["navbar_persistent"] == []
    assert (REPO / "_ext" / "course_book.py").is_file()
    layout = (REPO / "_templates" / "layout.html").read_text()
    assert '"scripts/fontawesome.js" not in line' in layout


def test_vendored_scripts_exist():
    config = yaml.safe_load((REPO / "_config.yml").read_text())["sphinx"]["config"]
    scripts = list(config["nb_ipywidgets_js"]) + [config["mathjax_path"]]
    for script in scripts:
        assert "://" not in script, f"{script} would be fetched from the internet"
        assert (REPO / "_static" / script).is_file(), \
            f"_static/{script} is missing: run `bash scripts/vendor_js.sh`"
        assert not script.endswith(".js"), \
            f"{script}: Jupyter Book would add every _static/**/*.js to every page"
    # MathJax's loader fetches each component from the file `source` maps it to
    loader = config["mathjax3_config"]["loader"]
    for name in loader["load"]:
        assert name in loader["source"], f"MathJax component {name} has no vendored source"
    for name, url in loader["source"].items():
        assert url.startswith("[mathjax]/") and url.endswith(".mjs"), url
        path = REPO / "_static" / "vendor" / "mathjax" / url.removeprefix("[mathjax]/")
        assert path.is_file(), f"{name}: {path} is missing: run `bash scripts/vendor_js.sh`"
    bundle = (REPO / "_static" / "vendor" / "html-manager" / "embed-amd.mjs").read_text()
    for module in ("@jupyter-widgets/base", "@jupyter-widgets/controls"):
        assert f'define("{module}"' in bundle, f"embed-amd does not bundle {module}"
