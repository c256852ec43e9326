"""Sphinx extension of this book (loaded from _config.yml, `local_extensions`).

* Solutions say what they are: a code cell tagged ``solution`` (folded away by its
  ``hide-cell`` tag) is labelled "Show solution" / "Hide solution" instead of myst-nb's
  "Show code cell content", which the folded setup and helper cells also carry.
* Buttons from the repository's address: with ``repository.url`` set in ``_config.yml``,
  the repository, issue and edit links are turned on (Jupyter Book refuses them in the
  config itself without a URL); without one, the launch buttons are removed, so no page
  carries a Binder or Colab link that cannot work.
* MathJax only where a page has math of its own: Sphinx counts a page as having equations
  when any page in its toctree does, so the root page (the introduction, whose toctree
  holds every chapter) loaded all of MathJax (1.3 MB) for no formula.
"""
from __future__ import annotations

from docutils import nodes

SOLUTION_TAG = "solution"
SHOW_SOLUTION = "Show solution"
HIDE_SOLUTION = "Hide solution"


def label_solutions(app, doctree) -> None:
    """Give every folded cell tagged ``solution`` the solution prompts."""
    for node in doctree.findall(nodes.container):
        if node.get("nb_element") != "cell_code" or "hide_mode" not in node:
            continue
        tags = (node.get("cell_metadata") or {}).get("tags") or []
        if SOLUTION_TAG in tags:
            node["prompt_show"] = SHOW_SOLUTION
            node["prompt_hide"] = HIDE_SOLUTION


REPOSITORY_BUTTONS = ("use_repository_button", "use_issues_button", "use_edit_page_button")


def buttons_from_repository(app, config) -> None:
    """Every link to the repository, or none: decided by ``repository.url`` alone."""
    options = config.html_theme_options
    has_url = bool(str(options.get("repository_url") or "").strip())
    for button in REPOSITORY_BUTTONS:
        options[button] = has_url
    if not has_url:
        options["launch_buttons"] = {}


def mathjax_only_with_math(app, pagename, templatename, context, doctree) -> None:
    """Drop MathJax from a page whose own text has no math (runs after sphinx.ext.mathjax)."""
    if app.builder.format != "html" or not app.config.mathjax_path:
        return
    own = app.env.get_domain("math").data["has_equations"].get(pagename, False)
    if own:
        return
    scripts = context.get("script_files")
    if scripts is None:
        return
    path = str(app.config.mathjax_path)

    def is_mathjax(js) -> bool:  # the script itself, or the inline `window.MathJax = {...}`
        name = str(getattr(js, "filename", js) or "")
        body = str(getattr(js, "attributes", {}).get("body", ""))
        return (bool(name) and name.endswith(path)) or body.startswith("window.MathJax")

    scripts[:] = [js for js in scripts if not is_mathjax(js)]


def setup(app):
    app.connect("config-inited", buttons_from_repository)
    app.connect("doctree-read", label_solutions)
    app.connect("html-page-context", mathjax_only_with_math, priority=600)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
