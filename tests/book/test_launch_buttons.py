"""Launch buttons and repository links come from `_config.yml`'s `repository.url` alone.

With a repository: the session's tiny book (``tiny_book_html`` in conftest.py: the real
`_config.yml` and `_ext/`, a repository URL set), whose chapter page must offer Binder and
Colab links that open *that* notebook and repository / issue / edit links. Without one (the
project's own setting today): the real book the suite builds (``book_server``), where
neither a chapter nor a prose page may carry such a link. Read in chromium, as a reader's
click sees it.
"""
from __future__ import annotations

import pytest
import yaml

from test_build import REPO, TINY_REPOSITORY as URL  # tests/book is on sys.path (no package)

pytestmark = pytest.mark.browser


def _links(page) -> list[str]:
    return page.page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")


def test_buttons_open_the_chapters_notebook_when_a_repository_is_set(
        tiny_book_html, serve, open_book_page):
    page = open_book_page(serve(tiny_book_html))
    page.open("notebooks/chapter.html")
    links = _links(page)
    assert ("https://mybinder.org/v2/gh/course-org/dist-llm/main"
            "?urlpath=lab/tree/notebooks/chapter.ipynb") in links, links
    assert ("https://colab.research.google.com/github/course-org/dist-llm/blob/main/"
            "notebooks/chapter.ipynb") in links, links
    assert URL in links
    assert any(link.startswith(f"{URL}/issues/new") for link in links), links
    assert f"{URL}/edit/main/notebooks/chapter.ipynb" in links, links
    page.open("intro.html")  # a prose page: repository links, no launch buttons
    intro = _links(page)
    assert URL in intro and not any("mybinder" in link or "colab" in link for link in intro)


def test_without_a_repository_no_page_has_a_launch_or_repository_link(
        book_server, open_book_page):
    assert yaml.safe_load((REPO / "_config.yml").read_text())["repository"]["url"] == ""
    page = open_book_page(book_server)
    for path in ("notebooks/01_communicator_groups.html", "book/intro.html"):
        page.open(path)
        links = _links(page)
        assert not any(host in link for link in links
                       for host in ("mybinder", "colab.research", "github.com")), (path, links)
