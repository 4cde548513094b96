"""Checkers of exercise 18 (the memory-budget puzzles): a device budget, ZeRO's stages, CPU offload, ring traffic.

Cites ZeRO (arXiv:1910.02054, sections 5.1 and 7); PyTorch FSDP (arXiv:2304.11277).
Design notes: docs/CLASSROOM.md, "Checkers", `budget.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CHECK_TIMEOUT,
    CheckFailure,
    call_learner,
    known_mistake,
    require_callable,
    say,
    say_passed,
)
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.memory import (
    DEVICE,
    DeviceOutOfMemory,
    attach,
    budget_formula,
    pool_bytes,
    pool_of,
    record_event,
    zero_formula,
)
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.cost_model import CostFit, ring_steps
from fsdp_course.runtime.ledger import traffic_formula
from fsdp_course.runtime.simulate import run_ranks

__all__ = ["RUN_CAPACITY", "RUN_SIZES", "check_bytes_sent", "check_comm_seconds", "check_device_peak",
           "check_smallest_world_size", "expected_comm_seconds", "expected_smallest_world_size", "run_with_budget"]

STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
MAX_WORLD_SIZE = 64
# (psi, unit_numel): lesson 18's MLP (8 layers of 65,792), a 1.3B model in 24 units, a small one in uneven units
MODELS = ((526_336, 65_792), (1_300_000_000, 52_000_000), (10_000, 4_000))
WORLD_SIZES = (1, 2, 3, 4, 8)
MiB = 2**20
# the model the checkers run for real: MLP([64] * 5), four units of 4,160 parameters, 4 samples per rank
RUN_SIZES = (64, 64, 64, 64, 64)
RUN_UNITS = [a * b + b for a, b in zip(RUN_SIZES[:-1], RUN_SIZES[1:], strict=True)]  # one per Linear
RUN_BATCH = 4
RUN_ACTIVATIONS = 2 * (len(RUN_SIZES) - 1) * RUN_BATCH * 64 * 4  # each layer's input and ReLU output, fp32
RUN_CAPACITY = 112 * 1024  # bytes per rank: ZeRO-3 fits from 4 ranks on, with offload from 1

T = catalogue("budget")  # fsdp_course/i18n/catalogues/budget.yml


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= 1e-6 * max(abs(expected), 1.0)


def _number(check: str, where: str, got: Any, allow_none: bool = False) -> float | None:
    if got is None and allow_none:
        return None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        CheckFailure(check, where, T("returned", kind=type(got).__name__, value=got),
                     T("plain_number_or_none" if allow_none else "plain_number")).fail()
    return float(got)


# -- device_peak -----------------------------------------------------------------------------------------------------
def _device_hint(got: float, psi: int, n: int, stage: int, offload: bool, unit: int) -> Message:
    expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)
    states = zero_formula(psi, n, stage, gathered_numel=unit)
    device, adam, gathered = expected["device"], states["optimizer"], states["gathered"]
    kept = ((T("kept_params_grads"), states["params"] + states["grads"]),
            (T("kept_params"), states["params"]),
            (T("kept_params_adam"), states["params"] + states["optimizer"]))
    unsharded = sum(states[k] * (n if stage >= s else 1) for k, s in (("params", 3), ("grads", 2), ("optimizer", 1)))
    named = known_mistake(got, [  # what each known mistake gives (None where it cannot be made), and its hint
        (device + expected["host"] if offload else None, lambda: T("offload_counted")),
        *[(device + nbytes if offload else None, lambda what=what: T("kept_on_device", what=what))
          for what, nbytes in kept],
        (device - adam if adam else None, lambda: T("forgot_moments")),
        (device - adam / 2 if adam else None, lambda: T("adam_two_tensors")),
        (device - gathered if stage == 3 else None, lambda: T("gathers_one_unit")),
        (device - gathered / 2 if stage == 3 else None, lambda: T("gathered_grad_full")),
        (device / 4, lambda: T("elements")),
        (unsharded + gathered if n > 1 else None, lambda: T("divide_by_n", stage=STAGES[stage])),
        *[(budget_formula(psi, n, other, gathered_numel=unit)["device"] if 0 <= other <= 3 and not offload else None,
           lambda other=other: T("neighbour_peak", other=STAGES[other], stage=STAGES[stage]))
          for other in (stage - 1, stage + 1)],
    ], _close)  # in the order of the old hints: the likelier mistake first
    if named is not None:
        return named
    if 0 < abs(got - device) < 8 and got == int(got):
        return T("rounded", got=got, expected=device, direction=T("down" if got < device else "up"))
    what = T(("shards_nothing", "shards_optimizer", "shards_grads", "shards_all")[stage])
    return T("per_parameter", stage=STAGES[stage], what=what, offload=T("offload_moves") if offload else "")


def run_with_budget(world_size: int, offload: bool, capacity: int, steps: int = 2) -> list[dict[str, Any]]:
    """Train the run model (ZeRO-3, the course's FSDP, one unit per Linear, Adam) on `world_size` ranks with the
    device budget on; per rank {"fits", "peak_device", "peak_label", "peak_snapshot", "sent", "collectives",
    "ring_steps", "error"}: the peak's snapshot is the bytes by category on the device at the recorded point where
    the device held the most."""
    from fsdp_course.fsdp.api import FSDP
    from fsdp_course.fsdp.policy import OffloadPolicy
    from fsdp_course.models import MLP

    torch.manual_seed(0)
    base = MLP(list(RUN_SIZES))

    def body(ctx: RankContext) -> dict[str, Any]:
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, offload_policy=OffloadPolicy() if offload else None)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(ctx.rank)
        try:
            recorder = attach(fsdp, opt, capacity=capacity)
            for _ in range(steps):
                ctx.ledger.clear()
                x, y = torch.randn(RUN_BATCH, RUN_SIZES[0], generator=g), torch.randint(0, RUN_SIZES[-1], (RUN_BATCH,),
                                                                                        generator=g)
                with recorder.track_activations():
                    loss = F.cross_entropy(fsdp(x), y)
                loss.backward()
                opt.step()
                record_event(fsdp, "optimizer step")
                opt.zero_grad()
        except DeviceOutOfMemory as e:
            return {"fits": False, "error": str(e), "category": e.category}
        records = list(ctx.ledger)
        at_peak = next(snap for _, snap in recorder.events if pool_bytes(snap, fsdp, DEVICE) == recorder.peak_device)
        return {"fits": True, "peak_device": recorder.peak_device, "peak_label": recorder.peak_device_label,
                "peak_snapshot": {c: b for c, b in at_peak.items() if b and pool_of(fsdp, c) == DEVICE},
                "sent": ctx.ledger.total()[0],
                "collectives": len(records),
                "ring_steps": sum(ring_steps(r.op, ctx.world_size) for r in records) if ctx.world_size > 1 else 0}

    return run_ranks(body, world_size, timeout=CHECK_TIMEOUT)


def check_device_peak(fn: Callable[[int, int, int, bool, int], float]) -> None:
    """Check `fn(psi, world_size, stage, offload, unit_numel)`: bytes on the device at the peak, fp32 Adam.

    Against `memory.budget_formula(...)["device"]` (activations left out) for stages 0-3 and ZeRO-3 with offload,
    then for real: ZeRO-3 on 2 ranks, with and without offload, with a budget of your prediction plus room for the
    activations, must run without running out of device memory."""
    check = "check_device_peak"
    name = require_callable(check, fn, "device_peak")
    for psi, unit in MODELS:
        for n in WORLD_SIZES:
            for stage, offload in ((0, False), (1, False), (2, False), (3, False), (3, True)):
                where = (f"psi {psi:,}, unit_numel {unit:,}, world size {n}, {STAGES[stage]}"
                         + (" with offload" if offload else ""))
                got = _number(check, where, call_learner(check, name, fn, psi, n, stage, offload, unit, where=where))
                expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"]
                if not _close(got, expected):
                    CheckFailure(check, where, T("got_bytes", got=got, expected=expected),
                                 _device_hint(got, psi, n, stage, offload, unit)).fail()
    psi, unit = sum(RUN_UNITS), max(RUN_UNITS)
    rows = []
    for offload in (False, True):
        where = f"{name}({psi}, 2, 3, {offload}, {unit})"
        predicted = _number(check, where, call_learner(check, name, fn, psi, 2, 3, offload, unit, where=where))
        capacity = int(predicted) + RUN_ACTIVATIONS
        ran = run_with_budget(2, offload, capacity)
        the_run = T("the_run", model=f"MLP{list(RUN_SIZES)}", psi=psi, offload=T("with_offload") if offload else "")
        if not ran[0]["fits"]:
            CheckFailure(check, str(the_run), T("ran_out_budget", activations=RUN_ACTIVATIONS), T("prediction_low"),
                         [ran[0]["error"]]).fail()
        rows.append((the_run, offload, predicted, ran[0]))
    say_passed(check, T("against_run", sizes=", ".join(map(str, WORLD_SIZES)), formula="budget_formula", real=2))
    for the_run, offload, predicted, ran0 in rows:
        say(T("peak", run=the_run, predicted=predicted, peak=ran0["peak_device"], label=ran0["peak_label"]),
            _peak_terms(psi, unit, 2, offload, ran0))


def _peak_terms(psi: int, unit: int, n: int, offload: bool, ran: dict[str, Any]) -> Message:
    """The measured peak as the formula's device bytes plus or minus what differs at that moment, each term read off
    the snapshot at the peak: the activations, Adam's step counts (a scalar tensor per flat parameter, which the
    formula's 8 bytes per parameter leave out), and the sharded gradient of the unit whose full gradient just became
    ready (the formula counts every unit's sharded gradient at once; that unit's is made only by the reduce-scatter
    that follows)."""
    formula = budget_formula(psi, n, 3, offload=offload, gathered_numel=unit)
    snap = ran["peak_snapshot"]
    activations = snap.get("activations", 0)
    steps = snap.get("optimizer", 0) - (0 if offload else formula["optimizer"])
    grads = snap.get("sharded_grads", 0) - (0 if offload else formula["grads"])
    other = ran["peak_device"] - formula["device"] - activations - steps - grads
    terms = T("term_formula", device=formula["device"])
    if grads < 0:
        name = ran["peak_label"].split()[-1]
        terms = (T("term_own_grad", before=terms, grads=-grads, name=name, unit=unit, n=n)
                 if _close(-grads, 4 * unit / n) else T("term_not_made", before=terms, grads=-grads))
    if steps:
        terms = T("term_steps", before=terms, steps=steps)
    terms = T("term_activations", before=terms, activations=activations)
    if other:
        terms = T("term_other", before=terms, sign="+" if other > 0 else "-", other=abs(other))
    return terms


# -- smallest_world_size ---------------------------------------------------------------------------------------------
def expected_smallest_world_size(psi: int, unit: int, capacity: float, stage: int, offload: bool) -> int | None:
    for n in range(1, MAX_WORLD_SIZE + 1):
        if budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"] <= capacity:
            return n
    return None


# a capacity that fits the 1.3B model's ZeRO-3 at N = MAX_WORLD_SIZE exactly, not at MAX_WORLD_SIZE - 1
EDGE_CAPACITY = budget_formula(1_300_000_000, MAX_WORLD_SIZE, 3, gathered_numel=52_000_000)["device"]
SMALLEST_CASES = (  # (psi, unit_numel, capacity in bytes, stage, offload)
    (526_336, 65_792, 3 * MiB, 3, False), (526_336, 65_792, 3 * MiB, 3, True), (526_336, 65_792, 3 * MiB, 2, False),
    (526_336, 65_792, 5 * MiB, 1, False), (526_336, 65_792, 3 * MiB, 0, False), (526_336, 65_792, 0.4 * MiB, 3, True),
    (1_300_000_000, 52_000_000, 80 * 2**30, 2, False), (1_300_000_000, 52_000_000, 2 * 2**30, 3, False),
    (1_300_000_000, 52_000_000, 1 * 2**30, 3, True), (10_000, 4_000, 80_000, 3, False),
    # a peak equal to the capacity fits: 16 Psi / 4 + 8 x 65,792 = 2,631,680 B at N = 4, to the byte
    (526_336, 65_792, 2_631_680, 3, False),
    # the edge of the search: the answer is the last N tried, then (one byte less) no N fits: None
    (1_300_000_000, 52_000_000, EDGE_CAPACITY, 3, False), (1_300_000_000, 52_000_000, EDGE_CAPACITY - 1, 3, False),
)


def _device_peak_blame(fn: Callable[..., Any], psi: int, unit: int, stage: int, offload: bool) -> Message | None:
    """If `fn` calls the learner's `device_peak` (a global of their notebook) and that gives another number than the
    formula at some N of the search, a hint that says so (the loop is not what is wrong), else None."""
    device_peak = getattr(fn, "__globals__", {}).get("device_peak")
    if not callable(device_peak) or "device_peak" not in getattr(getattr(fn, "__code__", None), "co_names", ()):
        return None
    for n in range(1, MAX_WORLD_SIZE + 1):
        expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"]
        try:
            got = float(device_peak(psi, n, stage, offload, unit))
        except Exception:  # noqa: BLE001  (the loop's own failure is reported instead)
            return None
        if not _close(got, expected):
            return T("blame_device_peak", got=got, n=n, expected=expected)
    return None


def _smallest_hint(got: float | None, psi: int, unit: int, capacity: float, stage: int, offload: bool) -> Message:
    def smallest(device: Callable[[int], float]) -> int | None:
        return next((n for n in range(1, MAX_WORLD_SIZE + 1) if device(n) <= capacity), None)

    def formula(n: int) -> dict[str, float]:
        return budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)

    if offload and got == smallest(lambda n: formula(n)["device"] + formula(n)["host"]):
        return T("offload_counted_search")
    if got == smallest(lambda n: formula(n)["device"] - zero_formula(psi, n, stage)["optimizer"]):
        return T("forgot_optimizer")
    if stage == 3 and got == smallest(lambda n: formula(n)["device"] - zero_formula(psi, n, stage,
                                                                                     gathered_numel=unit)["gathered"]):
        return T("holds_gathered_unit")
    if got is not None and got < 1:  # no world has fewer than one rank (and the formula refuses it)
        return T("at_least_one", got=got)
    expected = smallest(lambda n: formula(n)["device"])
    if got is None and expected == MAX_WORLD_SIZE:
        return T("never_tried", top=MAX_WORLD_SIZE, last=MAX_WORLD_SIZE - 1, stop=MAX_WORLD_SIZE + 1)
    strict = next((n for n in range(1, MAX_WORLD_SIZE + 1) if formula(n)["device"] < capacity), None)
    if got == strict and expected is not None and formula(expected)["device"] == capacity:
        return T("boundary", n=expected, capacity=capacity)
    if expected is None and got is not None and got > MAX_WORLD_SIZE:
        return T("past_search", top=MAX_WORLD_SIZE, got=got)
    if got is not None and got <= MAX_WORLD_SIZE and formula(int(got))["device"] > capacity:
        return T("needs_more", n=got, need=formula(int(got))["device"])
    return T("try_each", top=MAX_WORLD_SIZE)


def check_smallest_world_size(fn: Callable[[int, int, float, int, bool], int | None]) -> None:
    """Check `fn(psi, unit_numel, capacity, stage, offload)`: the smallest N in 1..64 whose device peak fits.

    Against the formula on SMALLEST_CASES, then for real: the run model with ZeRO-3 and a budget of RUN_CAPACITY
    (activations allowed for) must fit at your N and run out of memory at N - 1, with and without offload."""
    check = "check_smallest_world_size"
    name = require_callable(check, fn, "smallest_world_size")
    for psi, unit, capacity, stage, offload in SMALLEST_CASES:
        where = (f"psi {psi:,}, unit_numel {unit:,}, capacity {capacity:,.0f} B, {STAGES[stage]}"
                 + (" with offload" if offload else ""))
        raw = call_learner(check, name, fn, psi, unit, capacity, stage, offload, where=where)
        got = _number(check, where, raw, allow_none=True)
        expected = expected_smallest_world_size(psi, unit, capacity, stage, offload)
        if got != expected:
            CheckFailure(check, where, T("got_expected", got=raw, expected=expected),
                         _device_peak_blame(fn, psi, unit, stage, offload)
                         or _smallest_hint(got, psi, unit, capacity, stage, offload)).fail()
    psi, unit = sum(RUN_UNITS), max(RUN_UNITS)
    confirmed: dict[bool, Message] = {}
    sizes: set[int] = set()
    for offload in (False, True):
        asked = f"{name}({psi}, {unit}, {RUN_CAPACITY - RUN_ACTIVATIONS}, 3, {offload})"
        n = int(_number(check, asked, call_learner(check, name, fn, psi, unit, RUN_CAPACITY - RUN_ACTIVATIONS, 3,
                                                   offload, where=asked)))
        where = f"the run: MLP{list(RUN_SIZES)}, ZeRO-3{' with offload' if offload else ''}, {RUN_CAPACITY:,} B"
        ran = run_with_budget(int(n), offload, RUN_CAPACITY)
        if not ran[0]["fits"]:
            CheckFailure(check, where, T("n_ran_out", n=n), T("n_too_small"), [ran[0]["error"]]).fail()
        below = run_with_budget(int(n) - 1, offload, RUN_CAPACITY) if n > 1 else None
        if below is not None and below[0]["fits"]:
            CheckFailure(check, where, T("fits_too", n=n - 1), T("not_smallest")).fail()
        sizes |= {int(n), int(n) - 1} - {0}
        confirmed[offload] = T("fits", n=n, below=T("runs_out", n=n - 1, category=below[0]["category"])
                               if below is not None else "")
    say_passed(check, T("against_run", sizes=f"1-{MAX_WORLD_SIZE}", formula="budget_formula",
                        real=", ".join(map(str, sorted(sizes)))),
               T("run_budget", capacity=RUN_CAPACITY, plain=confirmed[False], offloaded=confirmed[True]))


# -- bytes_sent ------------------------------------------------------------------------------------------------------
def check_bytes_sent(fn: Callable[[int, int, int], float]) -> None:
    """Check `fn(psi, world_size, stage)`: fp32 bytes each rank sends per step under the ring model.

    Against `ledger.traffic_formula(4 * psi, N)` (stages 0-2: 2 Psi (N-1)/N elements, stage 3: 3 Psi (N-1)/N), then
    for real: the ledger of ZeRO-3 on 2 and 3 ranks (padded flat parameters) over one step."""
    check = "check_bytes_sent"
    name = require_callable(check, fn, "bytes_sent")
    for psi, _ in MODELS:
        for n in WORLD_SIZES:
            for stage in range(4):
                where = f"psi {psi:,}, world size {n}, {STAGES[stage]}"
                got = _number(check, where, call_learner(check, name, fn, psi, n, stage, where=where))
                formula = traffic_formula(4 * psi, n)
                expected = formula["fsdp" if stage == 3 else "ddp"]
                if not _close(got, expected):
                    CheckFailure(check, where, T("got_bytes", got=got, expected=expected),
                                 _traffic_hint(got, psi, n, stage)).fail()
    rows = []
    for n in (2, 3):
        padded = sum(padded_numel(u, n) for u in RUN_UNITS)
        sent = run_with_budget(n, False, 2**40, steps=1)[0]["sent"]
        asked = f"{name}({padded}, {n}, 3)"
        got = _number(check, asked, call_learner(check, name, fn, padded, n, 3, where=asked))
        if not _close(got, sent):
            CheckFailure(check, f"the run: ZeRO-3 on {n} ranks, {padded:,} padded parameters",
                         T("ledger_bytes", got=got, sent=sent), T("see_formula")).fail()
        rows.append(f"N = {n}: {sent:,.0f} B")  # data: the Chinese shows it as it is
    say_passed(check, T("against_ledger", sizes=", ".join(map(str, WORLD_SIZES)), formula="traffic_formula",
                        real="2, 3"),
               T("bytes_rows", rows="; ".join(rows)))


def _traffic_hint(got: float, psi: int, n: int, stage: int) -> Message:
    passes = 3 if stage == 3 else 2
    ring = (n - 1) / n
    return known_mistake(got, [(passes * 4 * psi, lambda: T("ring_n_minus_1")),  # the whole payload, not (N-1)/N
                               (passes * psi * ring, lambda: T("elements")),  # elements, not bytes
                               ((5 - passes) * 4 * psi * ring, lambda: T("two_or_three_passes"))],
                         _close) or T("traffic", stage=STAGES[stage], passes=passes)


# -- comm_seconds ----------------------------------------------------------------------------------------------------
def expected_comm_seconds(psi: int, n: int, units: int, alpha: float, beta: float) -> float:
    """ZeRO-3, `units` equal units: two all-gathers and a reduce-scatter of each unit's 4 psi / units bytes."""
    if n == 1:
        return 0.0
    fit = CostFit(alpha, beta, 1.0, 0.0, 1.0, 1.0, 0)
    per_unit = 4 * psi / units
    return units * (2 * fit.predict("all_gather", per_unit, n) + fit.predict("reduce_scatter", per_unit, n))


COMM_CASES = (  # (psi, world size, units, alpha s, beta s/B)
    (526_336, 4, 8, 20e-6, 1e-9), (526_336, 2, 8, 20e-6, 1e-9), (526_336, 1, 8, 20e-6, 1e-9),
    (1_300_000_000, 8, 24, 10e-6, 1 / 25e9), (1_300_000_000, 64, 24, 10e-6, 1 / 25e9), (10_000, 3, 5, 1e-3, 0.0),
)


def _comm_hint(got: float, psi: int, n: int, units: int, alpha: float, beta: float) -> Message:
    b = 4 * psi / units
    ring = (n - 1) / n * b * beta

    def total(steps: float, per_byte: float, collectives: int = 3, count: int = units) -> float:
        return count * collectives * (steps * alpha + per_byte)

    several = n > 1
    named = known_mistake(got, [  # what each known mistake gives (None where it cannot be made), and its hint
        *[(wrong if several else None, lambda: T("ring_steps"))  # N where the ring takes N - 1
          for wrong in (total(n, ring), total(n, b * beta), total(n - 1, b * beta))],
        (total(1, ring) if n > 2 else None, lambda: T("latency", k=n - 1)),
        (total(n - 1, ring * units) if several and units > 1 else None, lambda: T("bandwidth", units=units, psi=psi)),
        (total(n - 1, ring * units, count=1) if several else None, lambda: T("own_collective")),
        (total(n - 1, ring, collectives=2) if several else None, lambda: T("three_collectives")),
    ], _close)
    if named is not None:
        return named
    return T("one_rank") if n == 1 and got != 0 else T("per_unit")


def check_comm_seconds(fn: Callable[[int, int, int, float, float], float]) -> None:
    """Check `fn(psi, world_size, units, alpha, beta)`: ZeRO-3's communication seconds per step, α-β ring model.

    Against `CostFit.predict` on COMM_CASES, then against a real step's ledger on 2 and 3 ranks: with alpha = 1,
    beta = 0 your function must count the ring steps the ledger's collectives took; with alpha = 0, beta = 1 the bytes
    they sent."""
    check = "check_comm_seconds"
    name = require_callable(check, fn, "comm_seconds")
    for psi, n, units, alpha, beta in COMM_CASES:
        where = f"psi {psi:,}, world size {n}, {units} units, alpha {alpha:g} s, beta {beta:g} s/B"
        got = _number(check, where, call_learner(check, name, fn, psi, n, units, alpha, beta, where=where))
        expected = expected_comm_seconds(psi, n, units, alpha, beta)
        if not _close(got, expected):
            CheckFailure(check, where, T("got_seconds", got=got, expected=expected),
                         _comm_hint(got, psi, n, units, alpha, beta)).fail()
    units = len(RUN_UNITS)
    rows: Message | None = None
    for n in (2, 3):
        padded = sum(padded_numel(u, n) for u in RUN_UNITS)
        ran = run_with_budget(n, False, 2**40, steps=1)[0]
        steps, sent = (_number(check, f"{name}({padded}, {n}, {units}, {a}, {b})",
                               call_learner(check, name, fn, padded, n, units, a, b,
                                            where=f"{name}({padded}, {n}, {units}, {a}, {b})"))
                       for a, b in ((1.0, 0.0), (0.0, 1.0)))
        if not (_close(steps, ran["ring_steps"]) and _close(sent, ran["sent"])):
            CheckFailure(check, f"the run: ZeRO-3 on {n} ranks, {units} units",
                         T("ledger_steps", steps=steps, sent=sent, ledger_steps=ran["ring_steps"],
                           ledger_sent=ran["sent"]), T("see_formula")).fail()
        rows = (T("comm_row", n=n, collectives=ran["collectives"], ring_steps=ran["ring_steps"], sent=ran["sent"])
                if rows is None else T("comm_row_after", before=rows, n=n, collectives=ran["collectives"],
                                       ring_steps=ran["ring_steps"], sent=ran["sent"]))
    say_passed(check, T("against_ledger", sizes=", ".join(sorted({str(c[1]) for c in COMM_CASES}, key=int)),
                        formula="CostFit.predict", real="2, 3"),
               T("comm_rows", rows=rows))
