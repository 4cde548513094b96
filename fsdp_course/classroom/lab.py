"""Start the course's JupyterLab: on lesson 00, with a token, no pop-ups, and the URL printed.

Cites JupyterLab's overrides.json (its documentation of user directories).
Design notes: docs/CLASSROOM.md, "The classroom", `lab.py`.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from fsdp_course.runtime.ports import free_port

__all__ = ["free_port", "install_settings", "lab_command", "main"]

FIRST_LESSON = {"en": "lessons/00_welcome.ipynb", "zh": "lessons/zh/00_welcome.ipynb"}
_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def install_settings(prefix: str | Path = sys.prefix) -> Path:
    """Merge the course's JupyterLab settings into `<prefix>/share/jupyter/lab/settings/overrides.json`."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    for plugin, values in _OVERRIDES.items():
        current.setdefault(plugin, {}).update(values)
    path.write_text(json.dumps(current, indent=2) + "\n")
    return path


def lab_command(root: str | Path, *, port: int, token: str, open_browser: bool, default_url: str,
                expose_app: bool = False) -> list[str]:
    """The `jupyter lab` command line of the course's server."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--LabApp.default_url={default_url}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if not open_browser:
        cmd.append("--no-browser")
    if expose_app:
        cmd.append("--LabApp.expose_app_in_browser=True")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd


def main(argv: list[str] | None = None) -> None:
    """Open JupyterLab on lesson 00 of the course in the current directory."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsdp_course.classroom.lab", description=main.__doc__)
    parser.add_argument("--port", type=int, default=8888, help="first port to try (default 8888)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument("--lang", choices=sorted(FIRST_LESSON), default=None,
                        help="open the English (en) or the Chinese (zh) edition; default: FSDP_COURSE_LANG, else en")
    args = parser.parse_args(argv)
    from fsdp_course.i18n import language

    lesson = FIRST_LESSON[args.lang or ("zh" if os.environ.get("FSDP_COURSE_LANG") and language() == "zh" else "en")]
    root = Path.cwd()
    if not (root / lesson).exists():
        parser.error(f"{lesson} not found: run this from the course's top folder (where README.md is)")
    install_settings()
    port, token = free_port(args.port), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/lab/tree/{lesson}?token={token}"
    print(f"\n  fsdp-course: JupyterLab at {url}\n  (Ctrl-C to stop)\n", flush=True)
    cmd = lab_command(root, port=port, token=token, open_browser=not args.no_browser,
                      default_url=f"/lab/tree/{lesson}")
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
