"""Fixtures shared by every test folder."""
from __future__ import annotations

import compileall
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_4D = ROOT / "examples" / "train_4d.py"
#: The folders :func:`pytest_sessionstart` byte-compiles.
BYTE_COMPILED = ("tutorial_lib", "tests", "examples")


def pytest_sessionstart(session):
    """Byte-compile the library, the tests and the examples once, before any process starts.

    With ``PYTHONDONTWRITEBYTECODE`` set (as on the CI machines) Python never writes a
    ``.pyc``, so every worker, kernel and script compiled each module it imported again: an
    8-rank launch importing ``train_4d`` took 2.4 s instead of 1.4.  ``compileall`` writes
    them whatever that setting says; a file edited later is compiled afresh as usual (the
    ``.pyc`` records its source's time and size)."""
    for folder in BYTE_COMPILED:
        compileall.compile_dir(ROOT / folder, quiet=2)


@pytest.fixture(autouse=True)
def _fresh_hint_stages():
    """Every test starts with the exercise kit's staged hints at their first stage (the kit
    counts a case's failures per process, as a kernel would)."""
    from tutorial_lib.exercises import kit
    kit.forget_attempts()
    yield

@pytest.fixture(scope="module")
def train_4d_script():
    """``examples/train_4d.py`` loaded as a module (``main``, ``parse_args``,
    ``build_parser``, ...), once per test module that asks for it."""
    spec = importlib.util.spec_from_file_location("train_4d_under_test", TRAIN_4D)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # the machine's closed network would refuse these
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium_browser():
    """Debian's chromium, headless, launched once per session and shared by every test.

    One Playwright per session: a second ``sync_playwright()`` inside the first one's
    event loop is refused, so tests must not start their own.
    """
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `bash scripts/install_browser.sh` "
                    "(installs Debian's chromium; the browser tests never download one)",
                    pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class FragmentPage:
    """Widget HTML fragments on one ``file://`` page, with what went wrong recorded."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))

    def play_advances(self, animation, seconds: float = 3.0) -> int:
        """Click the player's Play button; its ``data-frame`` must rise within ``seconds``."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        start = int(animation.get_attribute("data-frame"))
        animation.locator(".tl-play").click()
        try:  # chromium looks at each animation frame, without a round trip per look
            self.page.wait_for_function(
                "([root, start]) => Number(root.getAttribute('data-frame')) > start",
                arg=[animation.element_handle(), start], timeout=seconds * 1000)
        except PlaywrightTimeout:
            pass
        now = int(animation.get_attribute("data-frame"))
        assert now > start, f"Play did not advance data-frame within {seconds:g} s"
        return now

    def assert_clean(self) -> None:
        """No script error on the page, and nothing fetched from outside the file."""
        assert self.errors == [], self.errors
        assert [u for u in self.requests if not u.startswith("file:")] == []


@pytest.fixture
def fragment_page(chromium_browser, tmp_path):
    """``open(*fragments, width=, height=)`` -> a :class:`FragmentPage`; pages close after the test."""
    opened = []

    def open_page(*fragments, width=1000, height=900):
        path = tmp_path / f"fragments{len(opened)}.html"
        path.write_text("<!doctype html><html><head><meta charset='utf-8'></head>"
                        "<body style='margin:24px;background:#f6f8fa'>" + "".join(fragments)
                        + "</body></html>", encoding="utf-8")
        view = FragmentPage(chromium_browser.new_page(viewport={"width": width, "height": height}))
        opened.append(view)
        view.page.goto(path.as_uri())
        return view

    yield open_page
    for view in opened:
        view.page.close()
