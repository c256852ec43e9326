"""Fixtures for the book tests: build the book, serve it on 127.0.0.1, drive it in chromium.

* ``book_html``: the real book, built once per session with ``scripts/build_book.sh``
  into a temporary folder (the chapters nbval already ran in this session are built from
  that run, not executed again: tests/executed_chapters.py); or, when ``TUTORIAL_BOOK_HTML``
  names a folder with an ``index.html`` (say ``_build/html`` after
  ``bash scripts/build_book.sh``), that build.
* ``book_server``: that folder served by ``http.server`` on 127.0.0.1 (a free port).
* ``toc_docname``: a test taking it runs once per document in ``_toc.yml``.
* ``build_book``, ``serve``, ``open_book_page``: the same machinery for a book of
  your own (a tiny book in ``tmp_path``).
* ``book_page``: a fresh chromium page that records console errors, page errors,
  failed requests and every request that tries to leave 127.0.0.1 (those are
  aborted, never sent). ``book_page.open(path)`` loads a page and returns the
  response; ``book_page.assert_clean()`` fails on anything unexpected.
* Widget helpers for the chapters' tests, as fixtures of the same names (take the
  fixture, call it): ``click_and_expect_change(page, selector, ...)`` and
  ``play_and_expect_advance(page, ...)``. See test_browser.py for both in use.

The browser is Debian's chromium (``bash scripts/install_browser.sh``), driven by the
python ``playwright`` package; no browser is ever downloaded.
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build_book.sh"

# Page errors or console messages at level "error" that a test tolerates: none. (Until
# an earlier build every page threw sphinx-thebe's "Identifier 'THEBE_JS_URL' has already been
# declared"; _config.yml now leaves that extension out, thebe being off.)
KNOWN_ERRORS: tuple[str, ...] = ()

LOCAL_HOSTS = {"127.0.0.1"}
LOCAL_SCHEMES = {"data", "blob", "about"}  # never leave the browser


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives the built book in Debian's chromium")


def pytest_generate_tests(metafunc):
    """A test that takes ``toc_docname`` runs once per document listed in _toc.yml."""
    if "toc_docname" in metafunc.fixturenames:
        # session scope: pytest runs every test of one document together, so that they
        # can share one loaded page per viewport (``book_view``)
        metafunc.parametrize("toc_docname", toc_docnames(), scope="session")


# --- the table of contents ----------------------------------------------------------------


def toc_docnames(toc_path: Path = REPO / "_toc.yml") -> list[str]:
    """Every document in a jb-book ``_toc.yml``, root first, without file extension."""
    import yaml

    toc = yaml.safe_load(toc_path.read_text())
    names = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                names.append(node["file"])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []) or []:
                    walk(child)

    walk(toc)
    return [os.path.splitext(n)[0] if n.endswith((".md", ".ipynb")) else n for n in names]


def toc_source(docname: str, root: Path = REPO) -> Path | None:
    """The source file of a toc entry, or None if it does not exist."""
    for ext in (".md", ".ipynb", ".rst"):
        path = root / f"{docname}{ext}"
        if path.exists():
            return path
    return None


# --- building and serving -----------------------------------------------------------------


def run_build(book_dir: Path, *extra: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Run ``scripts/build_book.sh BOOK_DIR EXTRA...``; output captured (stdout+stderr)."""
    return subprocess.run(
        ["bash", str(BUILD_SCRIPT), str(book_dir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def book_html(tmp_path_factory, request) -> Path:
    """Folder holding the built book's HTML (``index.html`` at its top)."""
    given = os.environ.get("TUTORIAL_BOOK_HTML")
    if given:
        html = Path(given).resolve()
        if not (html / "index.html").is_file():
            pytest.fail(f"TUTORIAL_BOOK_HTML={given!r} has no index.html; "
                        "build first with `bash scripts/build_book.sh` (HTML in _build/html)")
        return html
    out = tmp_path_factory.mktemp("book_build")
    started = time.monotonic()
    book, reused = book_with_executed_chapters(request.config, out / "source")
    result = run_build(book, "--path-output", str(out))
    if result.returncode != 0:
        pytest.fail(f"building the book failed (exit {result.returncode}); end of the log:\n"
                    + result.stdout[-6000:], pytrace=False)
    html = out / "_build" / "html"
    assert (html / "index.html").is_file(), result.stdout[-3000:]
    print(f"book built in {time.monotonic() - started:.1f} s into {html}; chapters run by "
          f"nbval and not again: {', '.join(reused) or 'none'}", file=sys.stderr)
    return html


COPY_IGNORED = shutil.ignore_patterns(".*", "_build", "__pycache__", "*.egg-info", "venv",
                                      "node_modules")
"""Left out of the copy: git, virtual environments and caches (a ``.venv`` in the checkout
would be gigabytes), earlier builds."""


def book_with_executed_chapters(config, folder: Path) -> tuple[Path, list[str]]:
    """The book to build: the repository itself, or, when nbval already ran chapters in this
    session (tests/executed_chapters.py), a copy of it in ``folder`` whose chapters carry
    those outputs and are excluded from execution; the other chapters run in the build.
    Returns the book's folder and the names of the chapters taken from nbval."""
    from tests.executed_chapters import executed_chapters

    import nbformat
    import yaml

    executed = {path: nb for path, nb in executed_chapters(config).items()
                if path.parent == REPO / "notebooks"}
    if not executed:
        return REPO, []
    shutil.copytree(REPO, folder, ignore=COPY_IGNORED)
    names = sorted(path.name for path in executed)
    for path, notebook in executed.items():
        nbformat.write(notebook, folder / "notebooks" / path.name)
    config_path = folder / "_config.yml"
    book_config = yaml.safe_load(config_path.read_text())
    book_config["execute"]["exclude_patterns"] = [f"notebooks/{name}" for name in names]
    config_path.write_text(yaml.safe_dump(book_config, sort_keys=False))
    return folder, names


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass


def serve_folder(folder: Path):
    """Start a threaded static server on 127.0.0.1:<free port>; returns (server, base_url)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="book-http", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}/"


@pytest.fixture
def build_book():
    """``build_book(book_dir, *extra_args)``: run scripts/build_book.sh, output captured."""
    return run_build


@pytest.fixture
def serve():
    """``serve(folder) -> base_url``: a static server on 127.0.0.1, stopped after the test."""
    servers = []

    def start(folder):
        server, url = serve_folder(Path(folder))
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def book_server(book_html):
    """Base URL (ending in '/') of the built book served on 127.0.0.1."""
    server, url = serve_folder(book_html)
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def tiny_book_html(tmp_path_factory) -> Path:
    """The HTML of one tiny book, built once for the browser tests that need a book of
    their own: test_build.tiny_book (the real _config.yml and what it names, an intro,
    ``notebooks/chapter.ipynb``) with test_build.TINY_REPOSITORY as its repository
    (launch buttons) and a second chapter, ``notebooks/widgets.ipynb``
    (test_build.WIDGET_NOTEBOOK)."""
    import json

    # tests/book is on sys.path (no package)
    from test_build import TINY_REPOSITORY, WIDGET_NOTEBOOK, set_repository, tiny_book

    root = tmp_path_factory.mktemp("tiny_book")
    book = tiny_book(root, "print(1)")
    (book / "notebooks" / "widgets.ipynb").write_text(json.dumps(WIDGET_NOTEBOOK))
    toc = book / "_toc.yml"
    toc.write_text(toc.read_text() + "  - file: notebooks/widgets\n")
    set_repository(book, TINY_REPOSITORY)
    out = root / "out"
    result = run_build(book, "--path-output", str(out), timeout=300)
    if result.returncode != 0:
        pytest.fail(f"building the tiny book failed (exit {result.returncode}):\n"
                    + result.stdout[-4000:], pytrace=False)
    return out / "_build" / "html"


# --- the browser --------------------------------------------------------------------------


class BookPage:
    """A chromium page on the served book that records everything that went wrong."""

    def __init__(self, context, base_url: str):
        self.context = context
        self.base_url = base_url
        self.page = context.new_page()
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.external_requests: list[str] = []
        self.failed_requests: list[str] = []
        self.bad_responses: list[str] = []
        self.loaded: list[str] = []  # URLs answered with a status < 400
        self.responses: list = []  # every response, for page weight
        context.route("**/*", self._route)
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda exc: self.page_errors.append(f"{exc}"))
        self.page.on("requestfailed", self._on_request_failed)
        self.page.on("response", self._on_response)

    # recording
    @staticmethod
    def is_local(url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in LOCAL_SCHEMES or parts.hostname in LOCAL_HOSTS

    def _route(self, route):
        url = route.request.url
        if self.is_local(url):
            route.continue_()
        else:
            self.external_requests.append(url)
            route.abort("blockedbyclient")  # never sent: this machine has no internet anyway

    def _on_console(self, msg):
        if msg.type == "error":
            text = msg.text
            loc = msg.location or {}
            if loc.get("url"):
                text += f"  ({loc.get('url')}:{loc.get('lineNumber')})"
            self.console_errors.append(text)

    def _on_request_failed(self, request):
        if self.is_local(request.url):  # external ones are reported as external_requests
            self.failed_requests.append(f"{request.url}: {request.failure}")

    def _on_response(self, response):
        self.responses.append(response)
        if response.status >= 400:
            self.bad_responses.append(f"{response.status} {response.url}")
        else:
            self.loaded.append(response.url)

    # use
    def url(self, path: str) -> str:
        return self.base_url + path.lstrip("/")

    def open(self, path: str, settle_ms: int = 300):
        """Load a page of the book; waits until the network is idle, returns the response."""
        response = self.page.goto(self.url(path), wait_until="networkidle", timeout=30_000)
        if settle_ms:
            self.page.wait_for_timeout(settle_ms)  # scripts that run after load (MathJax, widgets)
        return response

    @staticmethod
    def _unexpected(errors: list[str]) -> list[str]:
        return [e for e in errors if not any(known in e for known in KNOWN_ERRORS)]

    def problems(self) -> list[str]:
        out = []
        out += [f"request left 127.0.0.1: {u}" for u in self.external_requests]
        out += [f"page error: {e}" for e in self._unexpected(self.page_errors)]
        out += [f"console error: {e}" for e in self._unexpected(self.console_errors)]
        out += [f"failed request: {e}" for e in self.failed_requests]
        out += [f"HTTP {e}" for e in self.bad_responses]
        return out

    def assert_clean(self, what: str = "") -> None:
        problems = self.problems()
        assert not problems, (f"{what or self.page.url}:\n  " + "\n  ".join(problems))

    def screenshot(self, path, full_page: bool = True) -> None:
        self.page.screenshot(path=str(path), full_page=full_page)


@pytest.fixture
def open_book_page(chromium_browser):
    """``open_book_page(base_url, viewport=None) -> BookPage``: a fresh recording page on
    any served site (default viewport 1280 x 900; e.g. ``viewport=PHONE``)."""
    contexts = []

    def new(base_url: str, viewport: dict | None = None) -> BookPage:
        context = chromium_browser.new_context(viewport=viewport or {"width": 1280, "height": 900})
        contexts.append(context)
        return BookPage(context, base_url)

    yield new
    for context in contexts:
        context.close()


@pytest.fixture(scope="session")
def book_view(chromium_browser, book_server):
    """``book_view(docname, viewport) -> BookPage``: the page of a document of the real
    book, loaded once (and settled 800 ms) per viewport width and shared by every test of
    that document, which pytest runs together (``toc_docname`` is session-scoped); its
    ``response`` is the load's.  Moving on to another document closes the previous one's
    pages.  A test that changes the page must leave it as it found it."""
    views: dict[tuple[str, int], BookPage] = {}

    def view(docname: str, viewport: dict) -> BookPage:
        key = (docname, viewport["width"])
        if key not in views:
            for old in [k for k in views if k[0] != docname]:
                views.pop(old).context.close()
            views[key] = BookPage(chromium_browser.new_context(viewport=viewport), book_server)
            views[key].response = views[key].open(f"{docname}.html", settle_ms=800)
        return views[key]

    yield view
    for opened in views.values():
        opened.context.close()


@pytest.fixture
def book_page(open_book_page, book_server):
    """A fresh page (own context: no cache, no cookies) on the served real book."""
    return open_book_page(book_server)


# --- widget helpers (for the chapters' browser tests) ------------------------------------


_READ_JS = """([el, attr]) => attr === null ? el.outerHTML : el.getAttribute(attr)"""
_CHANGED_JS = """([el, attr, before]) =>
    (attr === null ? el.outerHTML : el.getAttribute(attr)) !== before"""


def click_and_expect_change(page, selector: str, *, watch: str | None = None,
                            attribute: str | None = None, timeout_ms: int = 3000,
                            nth: int = 0):
    """Click the ``nth`` element matching ``selector`` and wait until something changes.

    What must change: the attribute ``attribute`` (or, if None, the whole outerHTML) of the
    first element matching ``watch`` (default: the clicked element itself).
    ``page`` is a playwright Page or a :class:`BookPage`. Returns ``(before, after)``;
    raises AssertionError if nothing changed within ``timeout_ms``.
    """
    page = getattr(page, "page", page)
    target = page.locator(selector).nth(nth)
    target.wait_for(state="visible", timeout=10_000)
    watched = page.locator(watch).first if watch else target
    handle = watched.element_handle()
    before = page.evaluate(_READ_JS, [handle, attribute])
    target.click()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        page.wait_for_function(_CHANGED_JS, arg=[handle, attribute, before], timeout=timeout_ms)
    except PlaywrightTimeout:
        what = f"attribute {attribute!r}" if attribute else "content"
        raise AssertionError(
            f"clicking {selector!r} (#{nth}) did not change the {what} of "
            f"{watch or selector!r} within {timeout_ms} ms (still {before!r:.200})") from None
    after = page.evaluate(_READ_JS, [handle, attribute])
    return before, after


_FRAME_JS = """(root) => {
    const el = root.matches('[data-frame]') ? root : root.querySelector('[data-frame]');
    return el === null ? null : el.getAttribute('data-frame');
}"""
_ADVANCED_JS = """([root, before]) => {
    const el = root.matches('[data-frame]') ? root : root.querySelector('[data-frame]');
    return el !== null && Number(el.getAttribute('data-frame')) > before;
}"""


def play_and_expect_advance(page, root: str = ".tl-animation", *, play: str = "button.tl-play",
                            timeout_ms: int = 3000, nth: int = 0):
    """Click Play on the ``nth`` animation matching ``root``; wait for its frame to advance.

    The animation root carries a Play button (``play``, searched inside the root) and a
    frame indicator: the root itself or a descendant with a numeric ``data-frame``
    attribute. Returns ``(frame_before, frame_after)`` as ints; raises AssertionError if
    the frame did not increase within ``timeout_ms``.
    """
    page = getattr(page, "page", page)
    anim = page.locator(root).nth(nth)
    anim.wait_for(state="attached", timeout=10_000)
    handle = anim.element_handle()
    raw = page.evaluate(_FRAME_JS, handle)
    assert raw is not None, f"{root!r} (#{nth}) has no [data-frame] frame indicator"
    before = float(raw)
    button = anim.locator(play).first
    assert button.count() == 1, f"{root!r} (#{nth}) has no Play button {play!r}"
    button.click()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        page.wait_for_function(_ADVANCED_JS, arg=[handle, before], timeout=timeout_ms)
    except PlaywrightTimeout:
        now = page.evaluate(_FRAME_JS, handle)
        raise AssertionError(f"after clicking {play!r} in {root!r} (#{nth}) data-frame stayed "
                             f"at {now} (was {raw}) for {timeout_ms} ms") from None
    after = float(page.evaluate(_FRAME_JS, handle))
    return int(before), int(after)


@pytest.fixture(name="click_and_expect_change")
def _click_and_expect_change_fixture():
    return click_and_expect_change


@pytest.fixture(name="play_and_expect_advance")
def _play_and_expect_advance_fixture():
    return play_and_expect_advance


# --- page weight: recorded by test_reader.py, printed at the end of the session -----------

PAGE_WEIGHTS: dict[str, dict] = {}
"""``docname -> {"requests", "bytes", "gzip_bytes", "largest"}`` for each page weighed."""


@pytest.fixture(scope="session")
def page_weights() -> dict[str, dict]:
    """Where test_reader.py records each page's weight (printed at the end of the run)."""
    return PAGE_WEIGHTS


def pytest_terminal_summary(terminalreporter):
    if not PAGE_WEIGHTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("page weight (every file a page loads, 1440 x 900)")
    write(f"{'page':36s} {'files':>5s} {'bytes':>11s} {'gzipped':>11s}  largest")
    for name, w in PAGE_WEIGHTS.items():
        largest = ", ".join(f"{n} {b / 1e3:.0f} kB" for n, b in w["largest"])
        write(f"{name:36s} {w['requests']:5d} {w['bytes']:11,d} {w['gzip_bytes']:11,d}  {largest}")
