"""Per-rank output capture for ranks that are threads.

Why not `contextlib.redirect_stdout` per thread: `sys.stdout` is one process-wide attribute, so
threads that redirect it restore each other's streams and can leave the kernel's stdout dead.
And printing straight from threads in Jupyter interleaves mid-line and lands in whichever cell runs
when the stream is flushed (ipykernel routes output by the executing cell, not by thread).

What works (docs/ARCHITECTURE.md, "Traps of ranks as threads"): one thread-aware stream is put in place of
`sys.stdout` / `sys.stderr` while ranks run. Text written by a registered rank thread goes to that
rank's buffer; text from any other thread goes to the stream that was there before. After the
ranks have joined, `replay()` prints each rank's buffer in rank order, every line marked
`[rank R]`, so the cell's output is deterministic. C++ code writing to file descriptor 2 directly
(Gloo's own log lines) bypasses Python's streams and is not captured.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

__all__ = ["RankOutput", "capture_ranks"]


class RankOutput:
    """What one rank wrote, in order, as (stream name, text) pieces."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pieces: list[tuple[str, str]] = []

    def text(self, stream: str = "stdout") -> str:
        return "".join(t for s, t in self.pieces if s == stream)

    def lines(self, stream: str = "stdout") -> list[str]:
        text = self.text(stream)
        return text.splitlines() if text else []


class _ThreadRoutedStream:
    """A text stream that sends registered threads' writes to their own buffer."""

    def __init__(self, original: TextIO, name: str) -> None:
        self._original = original
        self._name = name
        self._routes: dict[int, RankOutput] = {}
        self._lock = threading.Lock()

    def register(self, ident: int, out: RankOutput) -> None:
        with self._lock:
            self._routes[ident] = out

    def unregister(self, ident: int) -> None:
        with self._lock:
            self._routes.pop(ident, None)

    @property
    def idle(self) -> bool:
        return not self._routes

    def write(self, text: str) -> int:
        out = self._routes.get(threading.get_ident())
        if out is None:
            return self._original.write(text)
        out.pieces.append((self._name, text))
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if threading.get_ident() not in self._routes:
            self._original.flush()

    def __getattr__(self, attr: str):  # encoding, isatty, fileno, ... of the real stream
        return getattr(self._original, attr)


class capture_ranks:  # noqa: N801  (used as a context manager, reads like a function)
    """Route each rank thread's prints to its own buffer for the duration of a `with` block.

    Threads register themselves with `register(rank)` from inside the rank thread. On exit the
    original streams are put back (if nobody else is still using the routed ones).
    """

    def __init__(self, world_size: int) -> None:
        self.outputs = [RankOutput(r) for r in range(world_size)]
        self._streams: dict[str, _ThreadRoutedStream] = {}
        self._installed: list[str] = []
        self._idents: list[int] = []

    def __enter__(self) -> capture_ranks:
        for name in ("stdout", "stderr"):
            current = getattr(sys, name)
            if isinstance(current, _ThreadRoutedStream):  # a run inside a run: share the router
                self._streams[name] = current
            else:
                routed = _ThreadRoutedStream(current, name)
                setattr(sys, name, routed)
                self._streams[name] = routed
                self._installed.append(name)
        return self

    def register(self, rank: int) -> None:
        """Call from the rank's own thread: its prints go to `self.outputs[rank]` from now on."""
        ident = threading.get_ident()
        self._idents.append(ident)
        for stream in self._streams.values():
            stream.register(ident, self.outputs[rank])

    def unregister(self) -> None:
        """Call from the rank's own thread when it is done."""
        for stream in self._streams.values():
            stream.unregister(threading.get_ident())

    def __exit__(self, *exc: object) -> None:
        for ident in self._idents:
            for stream in self._streams.values():
                stream.unregister(ident)
        for name in self._installed:
            routed = self._streams[name]
            if getattr(sys, name) is routed and routed.idle:
                setattr(sys, name, routed._original)

    def replay(self) -> None:
        """Print every rank's captured output in rank order, each line marked `[rank R]`."""
        for stream_name in ("stdout", "stderr"):
            target = getattr(sys, stream_name)
            for out in self.outputs:
                for line in out.lines(stream_name):
                    target.write(f"[rank {out.rank}] {line}\n")
            target.flush()
