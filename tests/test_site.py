"""The course's website (`make site`): built from the saved notebooks, then every page opened in headless Chromium.

One build of both languages and one crawl: every page loads with no console error and no request that leaves
127.0.0.1, its internal links and images resolve, answers, hints and "Going deeper" stay folded until opened,
and a Chinese page holds Chinese text and figures of its own. The crawl is skipped, with one line saying why,
where Debian's chromium is missing (as the browser test is)."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS, chromium_missing_reason
from playwright.sync_api import TimeoutError as PlaywrightTimeout

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / ".browser-screenshots"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "site" / "build.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def content_pages(site: Path) -> list[Path]:
    return sorted(p for lang in ("en", "zh") for sub in ("", "lessons/", "exercises/", "guides/")
                  for p in (site / lang).glob(f"{sub}*.html") if p.name not in ("genindex.html", "search.html"))


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and (tag, name) in {("a", "href"), ("img", "src"), ("script", "src"), ("link", "href")}:
                self.refs.append((tag, value))


def test_every_notebook_has_its_page_in_its_language_and_every_reference_resolves(site: Path) -> None:
    for sub in ("lessons", "exercises"):
        for nb in (ROOT / sub).glob("*.ipynb"):
            assert (site / "en" / sub / f"{nb.stem}.html").exists(), nb
            assert (site / "zh" / sub / f"{nb.stem}.html").exists(), nb
    broken, outside = [], []
    for page in content_pages(site) + [site / "index.html"]:
        parser = _Refs()
        parser.feed(page.read_text(encoding="utf-8"))
        for tag, ref in parser.refs:
            parts = urlsplit(ref)
            if parts.scheme in ("http", "https") or ref.startswith("//"):
                if tag != "a":  # a script, style sheet or image from the network
                    outside.append(f"{page.relative_to(site)}: {ref}")
                continue
            if parts.scheme or not parts.path:
                continue
            if not (page.parent / unquote(parts.path)).resolve().exists():
                broken.append(f"{page.relative_to(site)}: {ref}")
    assert not broken, broken[:20]
    assert not outside, outside[:20]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would bury the test's own report
        pass


@pytest.fixture(scope="module")
def browser_page(site: Path):
    reason = chromium_missing_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_Quiet, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.base = f"http://127.0.0.1:{server.server_address[1]}/"
        page.left = []  # requests for anything not on 127.0.0.1, refused
        page.route("**/*", lambda route: route.continue_() if urlsplit(route.request.url).hostname == "127.0.0.1"
                   else (page.left.append(route.request.url), route.abort()))
        yield page
        browser.close()
    server.shutdown()


def test_every_page_loads_with_no_error_no_network_and_its_images(site: Path, browser_page) -> None:
    page = browser_page
    problems: list[str] = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"{page.url}: console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"{page.url}: {e}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"{r.url}: HTTP {r.status}"))
    pages = content_pages(site)
    assert len(pages) >= 2 * 36
    for path in pages:
        page.goto(page.base + path.relative_to(site).as_posix(), wait_until="load")
        missing = page.evaluate("[...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
                                ".map(i => i.getAttribute('src'))")
        problems += [f"{path.relative_to(site)}: image {src} did not load" for src in missing]
    assert not page.left, page.left[:10]
    assert not problems, problems[:20]


def _open_lesson(page, lang: str, name: str) -> None:
    page.goto(f"{page.base}{lang}/lessons/{name}.html", wait_until="load")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_going_deeper_answers_and_hints_stay_folded(site: Path, browser_page, lang: str) -> None:
    page = browser_page
    _open_lesson(page, lang, "06_fsdp")
    deeper = page.locator("details.going-deeper")
    assert deeper.count() == 1 and not deeper.evaluate("d => d.open")
    assert not deeper.locator("p").first.is_visible(), "Going deeper's text shows before it is opened"
    deeper.locator("summary").click()
    assert deeper.locator("p").first.is_visible()
    inside = deeper.locator("section[id]").first.get_attribute("id")  # a link into the folded part opens it (the
    # browser opens a <details> that holds the fragment it navigates to)
    page.goto("about:blank")
    page.goto(f"{page.base}{lang}/lessons/06_fsdp.html#{inside}", wait_until="load")
    page.wait_for_function("document.querySelector('details.going-deeper').open")
    titles = page.locator("details summary").all_inner_texts()
    assert titles and not [t for t in titles if "*" in t or "<" in t], titles  # no markup leaks into a title
    answers = page.locator("details.sd-dropdown")
    assert answers.count() >= 1 and not any(answers.nth(i).evaluate("d => d.open") for i in range(answers.count()))
    page.goto(f"{page.base}{lang}/exercises/06_fsdp.html", wait_until="load")
    hints = page.locator("details", has=page.locator("summary b"))  # one folded block per hint, all closed
    assert hints.count() >= 3 and not any(hints.nth(i).evaluate("d => d.open") for i in range(hints.count()))
    _open_lesson(page, lang, "03_memory")  # a bookkeeping cell collapsed in JupyterLab: collapsed here too
    hidden = page.locator(".cell.tag_hide-input")
    assert hidden.count() >= 1 and not hidden.first.locator(".cell_input").is_visible()
    page.goto(f"{page.base}{lang}/exercises/06_fsdp.html", wait_until="load")
    twin = page.locator(".run-it a.twin")
    assert twin.count() == 1 and twin.get_attribute("href").endswith("exercises/06_fsdp.html")
    SHOTS.mkdir(exist_ok=True)
    _open_lesson(page, lang, "06_fsdp")
    page.screenshot(path=str(SHOTS / f"site-{lang}-06_fsdp.png"))
    page.goto(f"{page.base}{lang}/index.html", wait_until="load")
    page.screenshot(path=str(SHOTS / f"site-{lang}-home.png"))


def test_a_chinese_page_holds_chinese_text_and_figures_of_its_own(site: Path, browser_page) -> None:
    page = browser_page
    figures = {}
    for lang in ("en", "zh"):
        _open_lesson(page, lang, "06_fsdp")
        figures[lang] = [(site / lang / "lessons" / src).resolve().read_bytes()
                         for src in page.evaluate("[...document.images].map(i => i.getAttribute('src'))")
                         if src.startswith("../_images/")]
        text = page.locator("main").inner_text()
        cjk = sum("\u4e00" <= ch <= "\u9fff" for ch in text)
        assert (cjk > 1000) == (lang == "zh"), f"{lang}: {cjk} Chinese characters"
    assert figures["en"] and len(figures["en"]) == len(figures["zh"])
    assert all(a != b for a, b in zip(figures["en"], figures["zh"], strict=True)), "a Chinese figure is the English one"


@pytest.mark.parametrize(("lang", "query"), [("en", "reduce-scatter"), ("zh", "分片")])
def test_search_finds_pages_in_each_language(site: Path, browser_page, lang: str, query: str) -> None:
    page = browser_page
    page.goto(f"{page.base}{lang}/search.html?q={query}", wait_until="load")
    found = page.locator("#search-results ul.search li")
    found.first.wait_for(timeout=20_000)
    with contextlib.suppress(PlaywrightTimeout):  # the list fills one page at a time: wait for five, or the end
        page.wait_for_function("document.querySelectorAll('#search-results ul.search li').length >= 5", timeout=20_000)
    assert found.count() >= 5, f"{lang}: {found.count()} pages found for {query!r}"
