"""The simulator's referee: it sees every rank's collectives and stops mismatches and hangs early.

Real ranks are processes and cannot see each other, so a collective called with a different
operation, shape or dtype on one rank simply hangs until Gloo's timeout (or, worse, reduces the
wrong bytes). Ranks simulated as threads share memory, so before each collective every rank posts
its *signature* (operation, sequence number, shapes, dtype) here and waits until all ranks have
posted theirs. Then:

- signatures differ           -> every rank raises `CollectiveMismatch`, naming what differs;
- a peer finished or failed   -> the waiting ranks raise `CollectiveHang` / `PeerFailed` at once;
- a peer never arrives        -> after the timeout, `CollectiveHang` lists every rank's state.

Only then does the real Gloo collective run, so it never hangs on a mismatch. This is the same idea
as PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` collective fingerprinting, done in shared memory.

A subgroup (a row or column of a 2-D mesh, mesh.py) gets its own referee, `monitor.child(name, ranks)`: the same
rendezvous over the group's members, numbered by their rank in the group. It shares the world's abort flag, learns
when a member rank of the world ends, and writes its members' states into the world's report.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

__all__ = ["CollectiveHang", "CollectiveMismatch", "PeerFailed", "Signature", "WorldMonitor"]


@dataclass(frozen=True)
class Signature:
    """What one rank is about to run: compared across ranks before the real collective."""

    op: str
    seq: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    extra: str = ""  # e.g. "op=sum" or "src=0"

    def describe(self) -> str:
        shapes = ", ".join(str(tuple(s)) for s in self.shapes)
        extra = f", {self.extra}" if self.extra else ""
        return f"{self.op} #{self.seq} (shapes [{shapes}], {self.dtype}{extra})"


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives (or shapes, or dtypes) at the same sequence number."""


class CollectiveHang(RuntimeError):
    """A rank waited in a collective that some peer will never (or did not in time) join."""


class PeerFailed(RuntimeError):
    """This rank was released because another rank failed."""


class WorldMonitor:
    """Shared by the rank threads of one `run_ranks` call."""

    def __init__(self, world_size: int, timeout: float, *, parent: WorldMonitor | None = None,
                 ranks: list[int] | None = None, name: str = "") -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.parent = parent  # the world's referee, for a subgroup's
        self.ranks = list(ranks) if ranks is not None else list(range(world_size))  # member i is world rank ranks[i]
        self.name = name  # e.g. "shard group [0, 1]"
        self.abort = parent.abort if parent is not None else threading.Event()
        self._children: dict[str, WorldMonitor] = {}
        self.first_end: float | None = None  # time.monotonic() when the first rank finished or failed
        self._cond = threading.Condition()
        self._posted: dict[int, dict[int, Signature]] = {}  # seq -> rank -> signature
        self._left: dict[int, int] = {}  # seq -> ranks that have left the rendezvous
        self._state: list[str] = ["running, no collective yet"] * world_size
        self._done = [0] * world_size  # collectives completed per rank
        self._terminal = [False] * world_size
        self._gave_up: dict[int, str] = {}  # rank -> its "waiting in send/recv ..." state when that wait failed

    # -- rank states -------------------------------------------------------------------------------
    def _ended(self) -> None:
        if self.first_end is None:
            self.first_end = time.monotonic()

    def set_finished(self, rank: int) -> None:
        with self._cond:
            self._ended()
            self._state[rank] = f"finished after {self._done[rank]} collective(s)"
            self._terminal[rank] = True
            self._cond.notify_all()
        self._tell_children(rank, None)

    def set_failed(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            self._ended()
            self._state[rank] = f"failed with {type(exc).__name__} after {self._done[rank]} collective(s)"
            self._terminal[rank] = True
            if not isinstance(exc, (PeerFailed, CollectiveHang, CollectiveMismatch)):
                self.abort.set()
            self._cond.notify_all()
        self._tell_children(rank, exc)

    def collective_done(self, rank: int, sig: Signature) -> None:
        with self._cond:
            self._done[rank] += 1
            self._set_state(rank, f"running, last finished {sig.op} #{sig.seq}")

    def report(self) -> str:
        """Every rank's state, one line each; a rank whose send or recv failed says where it waited first."""
        return "\n".join(f"  rank {r}{self._who(r)}: {self._gave_up[r]}, until that wait failed (then {s})"
                         if r in self._gave_up and self._terminal[r] else f"  rank {r}{self._who(r)}: {s}"
                         for r, s in enumerate(self._state))

    # -- subgroups ---------------------------------------------------------------------------------
    def child(self, name: str, ranks: list[int]) -> WorldMonitor:
        """The referee of the subgroup `name` made of world ranks `ranks` (every member gets the same object)."""
        with self._cond:
            sub = self._children.get(name)
            if sub is None:
                sub = WorldMonitor(len(ranks), self.timeout, parent=self, ranks=ranks, name=name)
                sub._terminal = [self._terminal[g] for g in ranks]  # a member that already ended
                self._children[name] = sub
            elif sub.ranks != list(ranks):
                raise CollectiveMismatch(f"{name}: ranks {list(ranks)} here, {sub.ranks} on another rank")
            return sub

    def _tell_children(self, rank: int, exc: BaseException | None) -> None:
        """World rank `rank` ended: every subgroup it belongs to learns it (outside this referee's lock)."""
        with self._cond:
            children = [c for c in self._children.values() if rank in c.ranks]
        for sub in children:
            local = sub.ranks.index(rank)
            sub.set_finished(local) if exc is None else sub.set_failed(local, exc)

    def _who(self, rank: int) -> str:
        return f" (world rank {self.ranks[rank]})" if self.parent is not None else ""

    def _set_state(self, rank: int, text: str) -> None:
        """Called with the lock held; a subgroup's state shows in the world's report too (a plain list store)."""
        self._state[rank] = text
        if self.parent is not None:
            self.parent._state[self.ranks[rank]] = f"{text} in the {self.name}"

    # -- point-to-point: no rendezvous (a send and its recv are different calls), only states -------------
    def p2p_waiting(self, rank: int, what: str) -> None:
        with self._cond:
            self._set_state(rank, f"waiting in {what}")

    def p2p_done(self, rank: int, what: str) -> None:
        with self._cond:
            self._set_state(rank, f"running, last finished {what}")

    def p2p_diagnosis(self, rank: int | None = None) -> str:
        """Why a send or recv timed out, from every rank's state: a named deadlock, or the list of states.

        When every live rank waits in a send, the first line names the targets ("rank r waits in send to rank
        (r + 1) % N, its right neighbour") and, when all the ranks are at the same point, that point (the text
        after the target in each state, e.g. "reduce-scatter step 1 of 2" where a checker numbers the steps).
        `rank` is the rank whose wait failed: a rank whose wait failed earlier (and has ended since) still counts
        as waiting where it waited, so every rank names the same deadlock whichever timed out first.
        """
        with self._cond:
            if rank is not None and self._state[rank].startswith("waiting in"):
                self._gave_up[rank] = self._state[rank]
            live = {r: s for r, s in enumerate(self._state) if not self._terminal[r]}
            live.update({r: s for r, s in self._gave_up.items() if self._terminal[r]})
            report = self.report()
        ended = [r for r, s in enumerate(self._state) if s.startswith("finished")]
        if ended:
            return (f"rank(s) {', '.join(map(str, ended))} ended without posting the matching send or recv:\n"
                    f"{report}")
        if live and all(s.startswith("waiting in send") for s in live.values()):
            sends = _sends_described(live, len(self._state))
            return (f"deadlock: every rank waits in send while no rank receives ({sends};"
                    " a send completes only once its peer posts the matching recv). Post the receive first, or start "
                    f"the send with isend, then recv, then wait on the send.\n{report}")
        return f"a send or recv waited for a partner that never came:\n{report}"

    def state(self, rank: int) -> str:
        """What `rank` is doing as far as the referee knows ("waiting in ...", "running, last finished ...")."""
        with self._cond:
            return self._state[rank]

    # -- the rendezvous before each collective -----------------------------------------------------
    def check(self, rank: int, sig: Signature) -> None:
        """Block until every rank posted its signature for `sig.seq`; raise if they differ."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            posted = self._posted.setdefault(sig.seq, {})
            posted[rank] = sig
            self._set_state(rank, f"waiting in {sig.describe()}")
            self._cond.notify_all()
            try:
                while len(posted) < self.world_size:
                    if self.abort.is_set():
                        raise PeerFailed(f"rank {rank} released from {sig.op} #{sig.seq}: a peer failed")
                    missing = [r for r in range(self.world_size) if r not in posted]
                    if all(self._terminal[r] for r in missing):
                        raise CollectiveHang(
                            f"{sig.op} #{sig.seq}{self._where()} can never complete: rank(s) "
                            f"{', '.join(map(str, missing))} ended without joining it.\n{self.report()}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        short = (f" A timeout of {self.timeout:g} s is shorter than ranks take to reach a "
                                 "collective (they may arrive just after): give them a second or more."
                                 if self.timeout < 0.5 else "")
                        raise CollectiveHang(
                            f"timed out after {self.timeout:g} s in {sig.op} #{sig.seq}{self._where()}: rank(s) "
                            f"{', '.join(map(str, missing))} had not joined it by then.{short}\n{self.report()}")
                    self._cond.wait(min(remaining, 0.5))
                if len(set(posted.values())) > 1:  # any field differs: op, seq, shapes, dtype, op/src
                    lines = "\n".join(f"  rank {r}{self._who(r)}: {posted[r].describe()}" for r in sorted(posted))
                    where = f" in the {self.name}" if self.name else ""
                    raise CollectiveMismatch(f"collective mismatch{where} at call #{sig.seq}:\n{lines}")
                self._set_state(rank, f"in {sig.describe()}")
            except BaseException:
                if len(posted) < self.world_size:
                    del posted[rank]  # withdraw: a late peer must not run the real collective alone
                raise
            finally:
                self._left[sig.seq] = self._left.get(sig.seq, 0) + 1
                if self._left[sig.seq] == self.world_size:
                    del self._posted[sig.seq], self._left[sig.seq]

    def _where(self) -> str:
        return f" of the {self.name}" if self.name else ""


def _sends_described(waiting: dict[int, str], world_size: int) -> str:
    """"rank r waits in send to rank (r + 1) % N, its right neighbour, at <step>", from the states
    "waiting in send to rank P (<step>, ...)"."""
    targets, points = {}, set()
    for rank, state in waiting.items():
        match = re.match(r"waiting in send to rank (\d+)(?: \(([^,)]*))?", state)
        if match is None:
            return "see each rank below"
        targets[rank] = int(match.group(1))
        points.add(match.group(2) or "")
    n = world_size
    if len(waiting) == n and all(t == (r + 1) % n for r, t in targets.items()):
        text = "rank r waits in send to rank (r + 1) % N, its right neighbour"
    elif len(waiting) == n and all(t == (r - 1) % n for r, t in targets.items()):
        text = "rank r waits in send to rank (r - 1) % N, its left neighbour"
    else:
        text = ", ".join(f"rank {r} waits in send to rank {t}" for r, t in sorted(targets.items()))
    point = points.pop() if len(points) == 1 else ""
    return f"{text}, at {point}" if point and "step" in point else text
