"""A plain HTML table for chapter cells (the built book renders Markdown outputs without tables)."""
from __future__ import annotations

import html
import re


def table(header, rows):
    """Rows of values as an HTML table; text in backticks becomes ``<code>``."""
    from IPython.display import HTML

    def cell(value, tag):
        text = html.escape(str(value))
        text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
        return (f'<{tag} style="text-align:left;padding:3px 10px;'
                f'border-bottom:1px solid #d0d7de">{text}</{tag}>')

    head = "".join(cell(h, "th") for h in header)
    body = "".join("<tr>" + "".join(cell(v, "td") for v in row) + "</tr>" for row in rows)
    return HTML(f'<table class="tl-table" style="border-collapse:collapse;font-size:14px">'
                f"<tr>{head}</tr>{body}</table>")
