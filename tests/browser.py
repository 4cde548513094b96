"""Drive the course's own JupyterLab in headless Chromium, as a student would (used by test_browser.py).

The server is the one `make lab` starts (fsdp_course.classroom.lab.lab_command), on 127.0.0.1 with a token and
a free port, over a temporary copy of the notebooks. Chromium is Debian's (/usr/bin/chromium),
driven by the `playwright` package; no browser is ever downloaded.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from fsdp_course.classroom.lab import free_port, install_settings, lab_command

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]

# What JupyterLab's model says about every code cell after "Run All".
_CELLS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  return panel.content.widgets.filter(c => c.model.type === 'code').map((c, i) => ({
    index: i,
    tags: c.model.getMetadata('tags') || [],
    count: c.model.executionCount,
    outputs: c.model.outputs.toJSON().map(o => ({type: o.output_type, ename: o.ename || null,
        mimes: Object.keys(o.data || {}), text: o.text || (o.data && o.data['text/plain']) || ''})),
    images: c.node.querySelectorAll('.jp-OutputArea-output img').length,
    text: c.node.querySelector('.jp-OutputArea') ? c.node.querySelector('.jp-OutputArea').innerText : '',
  }));
}"""
_KERNEL_IDLE_JS = """() => {
  const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = p && p.sessionContext && p.sessionContext.session && p.sessionContext.session.kernel;
  return !!(k && k.status === 'idle' && p.content && p.content.widgets.length > 0);
}"""


@dataclass
class LessonRun:
    name: str
    cells: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    screenshot: Path | None = None

    def problems(self) -> list[str]:
        """Cells that did not run, or failed without being tagged `raises-exception`."""
        found = []
        for c in self.cells:
            errors = [o for o in c["outputs"] if o["type"] == "error"]
            if c["count"] is None:
                found.append(f"{self.name} code cell {c['index']} did not run")
            if errors and "raises-exception" not in c["tags"]:
                found.append(f"{self.name} code cell {c['index']} failed with {errors[0]['ename']}")
            if "raises-exception" in c["tags"] and not errors:
                found.append(f"{self.name} code cell {c['index']} is tagged raises-exception but did not raise")
        return found

    def images(self) -> int:
        return sum(c["images"] for c in self.cells)

    def png_outputs(self) -> int:
        return sum("image/png" in o["mimes"] for c in self.cells for o in c["outputs"])


class CourseLab:
    """The course's JupyterLab server plus one headless Chromium page."""

    def __init__(self, notebooks: list[Path], workdir: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fsdp_lab_", dir=workdir))
        for nb_path in notebooks:  # a copy without outputs: what the browser shows is what it ran
            nb = nbformat.read(nb_path, as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            # a Chinese notebook keeps its folder (lessons/zh/): its kernel starts there, which makes it speak Chinese
            dest = self.root / (Path(nb_path.parent.parent.name, "zh", nb_path.name) if nb_path.parent.name == "zh"
                                else Path(nb_path.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, dest)
        self.runtime = Path(tempfile.mkdtemp(prefix="fsdpr_"))
        self.port, self.token = free_port(0), secrets.token_hex(16)
        self.server: subprocess.Popen | None = None
        self._pw = self._browser = self.page = None

    def __enter__(self) -> CourseLab:
        install_settings()
        cmd = lab_command(self.root, port=self.port, token=self.token, open_browser=False,
                          default_url="/lab", expose_app=True)
        # kernels on Unix sockets in a short private runtime dir: no TCP port to lose to a Gloo socket
        # of the notebook another pytest worker runs (see conftest.py)
        cmd.append("--KernelManager.transport=ipc")
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.runtime)}
        self.server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       cwd=self.root, env=env)
        self._wait_for_server(90)
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        self.page = self._browser.new_page(viewport={"width": 1280, "height": 1600})
        return self

    def __exit__(self, *exc: object) -> None:
        for close in (lambda: self._browser.close(), lambda: self._pw.stop()):
            try:
                close()
            except Exception:  # noqa: BLE001  (closing what may never have opened)
                pass
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)

    def _wait_for_server(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        url = f"http://127.0.0.1:{self.port}/api/status?token={self.token}"
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.server.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    json.load(r)
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"jupyter lab did not answer on port {self.port} within {seconds:g} s")

    def run_all(self, name: str, screenshots: Path | None = None, timeout: float = 120) -> LessonRun:
        """Open a notebook, wait for its kernel, run all cells with JupyterLab's own command."""
        page, start = self.page, time.monotonic()
        # ?reset: a fresh workspace, so the only open notebook (and the one "Run All" acts on) is this one
        page.goto(f"http://127.0.0.1:{self.port}/lab/tree/{name}?reset&token={self.token}")
        page.wait_for_function(_KERNEL_IDLE_JS, timeout=timeout * 1000)
        page.wait_for_function(f"""() => {{ const p = window.jupyterapp.shell.currentWidget;
            return p.context.path === {json.dumps(name)} && p.context.isReady && p.sessionContext.isReady; }}""",
                               timeout=timeout * 1000)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        try:  # done when every code cell has an execution count, no prompt shows [*] and the kernel is idle
            page.wait_for_function("""() => {
                const p = window.jupyterapp.shell.currentWidget;
                const code = p.content.widgets.filter(c => c.model.type === 'code');
                const k = p.sessionContext.session.kernel;
                return k.status === 'idle' && code.every(c => c.model.executionCount !== null
                    && !(c.node.querySelector('.jp-InputPrompt') || {innerText: ''}).innerText.includes('*'));
            }""", timeout=timeout * 1000)
        except Exception:  # noqa: BLE001  (a timeout: the cells that did not run are reported below)
            pass
        run = LessonRun(name, page.evaluate(_CELLS_JS), time.monotonic() - start)
        if screenshots is not None:
            screenshots.mkdir(parents=True, exist_ok=True)
            run.screenshot = screenshots / f"{Path(name).stem}.png"
            page.screenshot(path=str(run.screenshot), full_page=False)
        return run

    def figure_sources(self) -> list[str]:
        """The base64 PNG of every figure shown in the open notebook's outputs."""
        return self.page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output img')]
            .map(i => i.src).filter(s => s.startsWith('data:image/png;base64,'))
            .map(s => s.slice('data:image/png;base64,'.length))""")

    def first_cell_text(self, timeout: float = 30) -> str:
        """The rendered text of the open notebook's first cell, scrolled into view (JupyterLab renders only the
        cells near the view, so after Run All the top of a long notebook is not on the page)."""
        self.page.evaluate("""async () => { const nb = window.jupyterapp.shell.currentWidget.content;
            nb.activeCellIndex = 0; await nb.scrollToItem(0); }""")
        self.page.wait_for_function("""() => { const c = window.jupyterapp.shell.currentWidget.content.widgets[0];
            return c.node.isConnected && c.node.innerText.trim().length > 0; }""", timeout=timeout * 1000)
        return self.page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets[0].node.innerText")

    def move_slider(self, handle_selector: str, readout_selector: str, key: str = "ArrowRight",
                    timeout: float = 30) -> tuple[str, str]:
        """Focus a slider's handle, press a key, return the readout text (before, after it changes)."""
        page = self.page
        readout = page.locator(readout_selector).first
        readout.wait_for(timeout=timeout * 1000)
        before = readout.inner_text()
        handle = page.locator(handle_selector).first
        handle.scroll_into_view_if_needed()
        handle.focus()
        page.keyboard.press(key)
        try:
            page.wait_for_function("([sel, t]) => document.querySelector(sel).innerText !== t",
                                   arg=[readout_selector, before], timeout=timeout * 1000)
        except Exception:  # noqa: BLE001  (playwright's TimeoutError: the readout did not change)
            pass
        return before, readout.inner_text()


def python_has_playwright() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return True


def chromium_missing_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return (f"{CHROMIUM} not found: the browser test needs Debian's chromium "
                "(sudo apt-get install chromium); skipped")
    if not python_has_playwright():
        return "the playwright package is not installed (pip install -e .); skipped"
    return None


__all__ = ["CHROMIUM", "CourseLab", "LessonRun", "chromium_missing_reason"]
