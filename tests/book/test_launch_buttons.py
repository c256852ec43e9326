"""Launch buttons and repository links come from `_config.yml`'s `repository.url` alone.

Two tiny books built with the real `_config.yml` and `_ext/` (see test_build.py): one with a
repository URL, whose chapter page must offer Binder and Colab links that open *that*
notebook and repository / issue / edit links; one without (the project's own setting
today), where no page may carry such a link. Read in chromium, as a reader's click sees it.
"""
from __future__ import annotations

import pytest

from test_build import tiny_book  # tests/book is on sys.path (no package)

pytestmark = pytest.mark.browser

URL = "https://github.com/course-org/dist-llm"


def _with_repository(book, url: str) -> None:
    config = book / "_config.yml"
    text = config.read_text()
    assert '  url: ""' in text  # the one place the address lives
    config.write_text(text.replace('  url: ""', f'  url: "{url}"', 1))


def _links(page) -> list[str]:
    return page.page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")


def test_buttons_open_the_chapters_notebook_when_a_repository_is_set(
        tmp_path, build_book, serve, open_book_page):
    book = tiny_book(tmp_path, "print(1)")
    _with_repository(book, URL)
    out = tmp_path / "out"
    result = build_book(book, "--path-output", str(out), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    page = open_book_page(serve(out / "_build" / "html"))
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
        tmp_path, build_book, serve, open_book_page):
    book = tiny_book(tmp_path, "print(1)")
    out = tmp_path / "out"
    result = build_book(book, "--path-output", str(out), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    page = open_book_page(serve(out / "_build" / "html"))
    for path in ("notebooks/chapter.html", "intro.html"):
        page.open(path)
        links = _links(page)
        assert not any(host in link for link in links
                       for host in ("mybinder", "colab.research", "github.com")), (path, links)
