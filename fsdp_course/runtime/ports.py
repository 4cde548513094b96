"""Ports and kernel sockets for what the course starts (JupyterLab, torchrun's store, Jupyter kernels), race-free.

A port found by binding to port 0 and closing the socket comes from the system's ephemeral range, the
range every outgoing connection and every Gloo pair socket also takes its ports from. While Gloo groups
run (in a notebook next door, in a parallel test), another socket can take that port before the server
binds it, and the server dies with "Address already in use". Two fixes, both here:

- `free_port()` picks a port *below* the ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range,
  32768-60999 by default; macOS and Windows start theirs at 49152), where only explicit binds land.
- `kernel_transport()` gives Jupyter kernels Unix-domain (`ipc`) sockets in a private directory instead
  of five TCP ports picked the racy way (jupyter_client's `KernelManager.transport`, see
  https://jupyter-client.readthedocs.io/en/latest/kernels.html#connection-files).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

__all__ = ["free_port", "kernel_transport", "remove_kernel_dir"]

_LOWEST = 20000  # below every system's ephemeral range, above the well-known and registered services in use
_private_dir: Path | None = None


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(start: int = 0, tries: int = 50) -> int:
    """A free port on 127.0.0.1: the first from `start` on, or (start=0) a random one outside the ephemeral range."""
    if start < 0 or start > 65535:
        raise ValueError(f"start={start}: a port is 0 (any) or 1..65535")
    if start:
        for port in range(start, min(start + tries, 65536)):
            if _bindable(port):
                return port
        raise RuntimeError(f"no free port in {start}..{start + tries - 1}: pass another port")
    end = _ephemeral_start()
    if end - _LOWEST < 1000:  # an unusual range: fall back to the system's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()  # not the global RNG: lessons seed that one
    for _ in range(max(tries, 100)):
        port = rng.randrange(_LOWEST, end)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port found in {_LOWEST}..{end - 1}")


def kernel_transport() -> dict[str, str]:
    """Keyword arguments for a jupyter_client KernelManager: `ipc` sockets with a fresh path (TCP on Windows)."""
    global _private_dir
    if os.name == "nt":
        return {}
    if _private_dir is None or not _private_dir.is_dir():
        # short on purpose: a Unix socket path has at most ~107 bytes
        _private_dir = Path(tempfile.mkdtemp(prefix="fsdpk_"))
        atexit.register(shutil.rmtree, _private_dir, True)
    return {"transport": "ipc", "ip": str(_private_dir / uuid.uuid4().hex[:12])}


def remove_kernel_dir() -> None:
    """Remove `kernel_transport()`'s directory now: atexit does it too, but not in a process that ends with
    os._exit: pytest-xdist's workers (conftest.py calls this at the end of the session) and the
    grader's (autograde, after its one kernel). Only once no kernel of this process needs its sockets."""
    global _private_dir
    if _private_dir is not None:
        shutil.rmtree(_private_dir, ignore_errors=True)
        _private_dir = None
