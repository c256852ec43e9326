"""Sphinx extension of this book (loaded from _config.yml, `local_extensions`).

* Solutions say what they are: a code cell tagged ``solution`` (folded away by its
  ``hide-cell`` tag) is labelled "Show solution" / "Hide solution" instead of myst-nb's
  "Show code cell content", which the folded setup and helper cells also carry.
* Buttons from the repository's address: with ``repository.url`` set in ``_config.yml``,
  the repository, issue and edit links are turned on (Jupyter Book refuses them in the
  config itself without a URL); without one, the launch buttons are removed, so no page
  carries a Binder or Colab link that cannot work.
* Captions numbered and cross-referenceable: a markdown paragraph that is all emphasis and
  starts "Figure N.M." or "Table N.M." is the caption of the output just above it (the
  previous cell's figure, widget or table). The build wraps that cell and its caption in
  one ``<figure id="figure-n-m">`` with a ``<figcaption>``, registers the label
  ``figure-n-m`` (``table-n-m``) so that ``{ref}`figure-8-1``` links to it from any page,
  and warns (so fails under ``-W``) when a caption follows no rendered output, names
  another chapter, or breaks the order 1, 2, 3, ... of its chapter. In Jupyter the same
  caption is the italic line under the output.
* MathJax only where a page has math of its own: Sphinx counts a page as having equations
  when any page in its toctree does, so the root page (the introduction, whose toctree
  holds every chapter) loaded all of MathJax (1.3 MB) for no formula.
* Bibliography entries are list items: docutils writes the citation list as
  ``role="list"`` and each entry as ``role="doc-biblioentry"``, a role DPUB-ARIA 1.1
  deprecated, so assistive technology (and axe, which reports it as critical) sees a list
  whose children are the entries' links; each entry gets ``role="listitem"`` instead.
"""
from __future__ import annotations

import re

from docutils import nodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)

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


CAPTION = re.compile(r"^(Figure|Table) (\d+)\.(\d+)\. ")
"""How a caption starts: its kind and number, "Figure 8.1. " (chapter 8, the first)."""
CHAPTER_DOCUMENT = re.compile(r"(?:^|/)(\d\d)_[^/]*$")


class course_figure(nodes.General, nodes.Element):
    """A captioned output: the cell above a caption, and the caption (HTML ``<figure>``)."""


class course_caption(nodes.Part, nodes.Element):
    """The caption of a :class:`course_figure` (HTML ``<figcaption>``)."""


def caption_label(node) -> str:
    """What ``{ref}`` shows for a captioned output: "Figure 8.1"."""
    return node.get("label", "")


def caption_of(paragraph) -> re.Match | None:
    """The caption's kind and number when ``paragraph`` is a caption, else ``None``."""
    if not isinstance(paragraph, nodes.paragraph) or len(paragraph.children) != 1:
        return None
    only = paragraph.children[0]
    if not isinstance(only, nodes.emphasis):
        return None
    return CAPTION.match(only.astext())


def rendered_output(cell) -> bool:
    """Whether ``cell`` is a code cell that left an output on the page."""
    if not (isinstance(cell, nodes.container) and cell.get("nb_element") == "cell_code"):
        return False
    return any(child.get("nb_element") == "cell_code_output" and child.children
               for child in cell.children if isinstance(child, nodes.Element))


class NumberedCaptions(SphinxTransform):
    """Each caption paragraph and the output above it become one numbered figure."""

    default_priority = 500  # before SphinxDomains (850) registers the labels

    def apply(self, **kwargs) -> None:
        chapter = CHAPTER_DOCUMENT.search(self.env.docname)
        seen = {"Figure": 0, "Table": 0}
        for paragraph in list(self.document.findall(nodes.paragraph)):
            match = caption_of(paragraph)
            if match is None:
                continue
            kind, number = match.group(1), (int(match.group(2)), int(match.group(3)))
            label = f"{kind} {number[0]}.{number[1]}"
            seen[kind] += 1
            if chapter is None or number != (int(chapter.group(1)), seen[kind]):
                want = (f"{kind} {int(chapter.group(1))}.{seen[kind]}" if chapter
                        else "a caption only in a chapter")
                logger.warning(f"caption {label!r} out of order: expected {want}",
                               location=paragraph)
            parent = paragraph.parent
            index = parent.index(paragraph)
            cell = parent[index - 1] if index > 0 else None
            if cell is None or not rendered_output(cell):
                logger.warning(f"{label} follows no rendered output: the cell above a "
                               f"caption must show the figure, widget or table",
                               location=paragraph)
                continue
            figure = course_figure(label=label, classes=["course-figure"])
            figure["names"].append(f"{kind.lower()}-{number[0]}-{number[1]}")
            caption = course_caption("", paragraph.deepcopy(), classes=["course-caption"])
            parent.remove(cell)
            figure += cell
            figure += caption
            parent.replace(paragraph, figure)
            self.document.note_explicit_target(figure, figure)


def visit_course_figure(self, node) -> None:
    self.body.append(self.starttag(node, "figure"))


def depart_course_figure(self, node) -> None:
    self.body.append("</figure>\n")


def visit_course_caption(self, node) -> None:
    self.body.append(self.starttag(node, "figcaption"))


def depart_course_caption(self, node) -> None:
    self.body.append("</figcaption>\n")


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


DEPRECATED_ENTRY_ROLE = 'role="doc-biblioentry"'
ENTRY_ROLE = 'role="listitem"'


def bibliography_entries_as_list_items(app, pagename, templatename, context, doctree) -> None:
    """Give each citation entry of a page the list item role its list requires."""
    body = context.get("body")
    if isinstance(body, str) and DEPRECATED_ENTRY_ROLE in body:
        context["body"] = body.replace(DEPRECATED_ENTRY_ROLE, ENTRY_ROLE)


def setup(app):
    app.add_enumerable_node(course_figure, "course-figure", caption_label,
                            html=(visit_course_figure, depart_course_figure))
    app.add_node(course_caption, html=(visit_course_caption, depart_course_caption))
    app.add_transform(NumberedCaptions)
    app.connect("config-inited", buttons_from_repository)
    app.connect("doctree-read", label_solutions)
    app.connect("html-page-context", mathjax_only_with_math, priority=600)
    app.connect("html-page-context", bibliography_entries_as_list_items)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
