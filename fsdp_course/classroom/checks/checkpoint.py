"""Checker of exercise 08: a sharded checkpoint, saved per rank, loaded back exactly by other processes.

Cites PyTorch FSDP's SHARDED_STATE_DICT (arXiv:2304.11277).
Design notes: docs/CLASSROOM.md, "Checkers", `checkpoint.py`.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import tempfile
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CHECK_TIMEOUT,
    CheckFailure,
    hints,
    not_implemented,
    require_callable,
    require_world_sizes,
    run_checked,
    say_passed,
)
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.launch import start_torchrun, torchrun_command
from fsdp_course.runtime.simulate import RankError, run_ranks

__all__ = ["check_sharded_checkpoint", "compare_states", "rank_state", "trained_fsdp"]

WORLD_SIZES = (1, 2, 3)
TORCHRUN_WORLD_SIZE = 2
TORCHRUN_TIMEOUT = 120.0  # seconds: three fresh Python processes importing torch on a busy laptop

T = catalogue("checkpoint")  # fsdp_course/i18n/catalogues/checkpoint.yml


def rank_state(fsdp: Any, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards and their Adam state as one flat dict of tensors (copies)."""
    state: dict[str, torch.Tensor] = {}
    for i, shard in enumerate(fsdp.flat_params):
        state[f"flat_param.{i}"] = shard.detach().clone()  # (padded_numel // N,) this rank's shard
        for key, value in optimizer.state.get(shard, {}).items():
            state[f"{key}.{i}"] = value.detach().clone()  # exp_avg, exp_avg_sq (shard-sized), step (scalar)
    return state


def trained_fsdp(ctx: RankContext, steps: int = 2) -> tuple[Any, torch.optim.Optimizer]:
    """A tiny Transformer classifier under the course's FSDP (one unit per encoder layer), after `steps` AdamW steps."""
    from fsdp_course.fsdp.api import FSDP
    from fsdp_course.models import TransformerClassifier, TransformerConfig

    model = _base_model(TransformerClassifier, TransformerConfig)
    fsdp = FSDP(copy.deepcopy(model), ctx, wrap={nn.TransformerEncoderLayer})
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        tokens = torch.randint(0, 17, (4, 16), generator=g)
        F.cross_entropy(fsdp(tokens), tokens[:, 0] % 10).backward()
        opt.step()
        opt.zero_grad()
    return fsdp, opt


_MODELS: dict[str, nn.Module] = {}  # a cache of one immutable model (every run trains a deep copy)
_MODELS_LOCK = threading.Lock()


def _base_model(cls: Any, config_cls: Any) -> nn.Module:
    """Built once per process, by the first rank thread that asks, under a lock and fork_rng: threads share the
    global RNG, so two ranks seeding and drawing from it at once would build different models."""
    with _MODELS_LOCK:
        if "tiny" not in _MODELS:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                _MODELS["tiny"] = cls(config_cls.tiny())
        return _MODELS["tiny"]


def compare_states(got: object, expected: dict[str, torch.Tensor]) -> list[Message]:
    """What differs between a loaded state and the saved one ([] if equal bit for bit, dtypes and shapes too). The
    Messages' fields are plain JSON data, so that a torchrun process can send them back (`_to_json`)."""
    if not isinstance(got, dict):
        return [T("load_not_dict", kind=type(got).__name__)]
    problems = []
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        problems.append(T("keys_differ", missing=missing, extra=extra))
    for key in sorted(set(expected) & set(got)):
        g, e = got[key], expected[key]
        if not isinstance(g, torch.Tensor):
            problems.append(T("not_tensor", name=key, kind=type(g).__name__))
        elif g.dtype != e.dtype or g.shape != e.shape:
            problems.append(T("dtype_shape", name=key, got=f"{g.dtype} {tuple(g.shape)}",
                              saved=f"{e.dtype} {tuple(e.shape)}"))
        elif not torch.equal(g, e):
            problems.append(T("values_differ", name=key, diff=float((g.double() - e.double()).abs().max())))
    return problems


def _to_json(problems: list[Message]) -> list[list[Any]]:
    """`compare_states`' Messages as JSON data ([id, fields] each), for a torchrun process's report."""
    return [[p.id, dict(p.fields)] for p in problems]


_SCRIPT = '''\
import json, os, sys
from pathlib import Path

import torch

from fsdp_course import RankContext
from fsdp_course.classroom.checks.checkpoint import _to_json, compare_states

{source}

ctx = RankContext.from_env(timeout=60)
try:
    expected = torch.load(os.path.join({expected!r}, f"rank{{ctx.rank}}.pt"), weights_only=True)
    got = {name}(ctx, {directory!r})
    report = {{"rank": ctx.rank, "problems": _to_json(compare_states(got, expected))}}
except Exception as exc:
    report = {{"rank": ctx.rank, "error": f"{{type(exc).__name__}}: {{exc}}"}}
# a file per rank: two processes printing to one pipe can interleave their lines
Path({reports!r}, f"rank{{ctx.rank}}.json.tmp").write_text(json.dumps(report))
os.replace(os.path.join({reports!r}, f"rank{{ctx.rank}}.json.tmp"), os.path.join({reports!r}, f"rank{{ctx.rank}}.json"))
ctx.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
ctx.close()
'''


_load_hint = hints((FileNotFoundError, T("same_names")), ("weights_only", T("plain_tensors")),
                   ("Unsupported global", T("plain_tensors")))


def check_sharded_checkpoint(save: Callable[[RankContext, dict[str, torch.Tensor], str], Any],
                             load: Callable[[RankContext, str], dict[str, torch.Tensor]],
                             world_sizes: Sequence[int] = WORLD_SIZES, *, torchrun: bool = True) -> None:
    """Check `save(ctx, state, directory)` and `load(ctx, directory) -> state` for a sharded checkpoint.

    Per world size, the ranks (threads) train a tiny FSDP Transformer, `save` their `rank_state`
    into a fresh directory, then `load` it back: every tensor must come back bit for bit (dtype,
    shape, values), each rank must have written its own file, and `save` must end with a collective
    (the checkpoint is complete when any rank returns). Loading on a different world size must
    raise on every rank. Finally (unless torchrun=False) two processes started by torchrun load
    what the threads saved at world size 2.
    """
    check = "check_sharded_checkpoint"
    save_name = require_callable(check, save, "save_sharded")
    load_name = require_callable(check, load, "load_sharded")
    world_sizes = require_world_sizes(world_sizes)
    if torchrun and TORCHRUN_WORLD_SIZE not in world_sizes:  # before any training, not after it
        raise ValueError(f"torchrun loads the world-size-{TORCHRUN_WORLD_SIZE} checkpoint: keep "
                         f"{TORCHRUN_WORLD_SIZE} in world_sizes (or pass torchrun=False)")
    with tempfile.TemporaryDirectory(prefix="fsdp_course_ckpt_") as tmp:
        for n in world_sizes:
            directory = os.path.join(tmp, f"ckpt_n{n}")
            expected_dir = os.path.join(tmp, f"expected_n{n}")
            os.makedirs(expected_dir)
            phase = ["training"] * n

            def body(ctx: RankContext, directory: str = directory, expected_dir: str = expected_dir,
                     phase: list = phase) -> list[str]:
                fsdp, opt = trained_fsdp(ctx)
                state = rank_state(fsdp, opt)
                torch.save(state, os.path.join(expected_dir, f"rank{ctx.rank}.pt"))
                phase[ctx.rank] = save_name
                ctx.ledger.clear()
                save(ctx, {k: v.clone() for k, v in state.items()}, directory)
                synced = bool(ctx.ledger.records)
                ctx.barrier()  # the checker's own: every rank has returned from save before any rank loads
                phase[ctx.rank] = load_name
                got = load(ctx, directory)
                return [synced, compare_states(got, state)]

            results = run_checked(check, save_name, body, n, lambda r, n=n, p=phase: f"world size {n}, rank {r} "
                                  f"(in {p[r]})", _load_hint)
            _check_results(check, n, results, directory)
        passed = [T("passed_saved")]
        if max(world_sizes) >= 2:
            _check_wrong_world_size(check, load, load_name, tmp, max(world_sizes))
            passed.append(T("passed_wrong_size", n=max(world_sizes), m=max(world_sizes) + 1))
        if torchrun:
            _check_torchrun(check, load, load_name, tmp)
            passed.append(T("passed_torchrun", n=TORCHRUN_WORLD_SIZE))
    say_passed(check, world_sizes, *passed)


def _check_results(check: str, n: int, results: list[list[Any]], directory: str) -> None:
    for rank, (synced, problems) in enumerate(results):
        if problems:
            CheckFailure(check, f"world size {n}, rank {rank}", T("state_differs", problem=problems[0]),
                         T("save_as_is"), [str(p) for p in problems[1:6]]).fail()
        if n > 1 and not synced:
            CheckFailure(check, f"world size {n}, rank {rank}", T("no_collective", rank=rank),
                         T("end_with_barrier")).fail()
    files = [p for p in Path(directory).rglob("*") if p.is_file()]
    if len(files) < n:
        CheckFailure(check, f"world size {n}", T("too_few_files", files=len(files), n=n), T("own_file")).fail()


def _check_wrong_world_size(check: str, load: Callable, load_name: str, tmp: str, n: int) -> None:
    directory = os.path.join(tmp, f"ckpt_n{n}")
    try:
        run_ranks(lambda ctx: load(ctx, directory), n + 1, timeout=CHECK_TIMEOUT)
    except RankError as err:
        if all(isinstance(e, NotImplementedError) for e in err.failures.values()):
            raise not_implemented(load_name) from None
        silent = sorted(set(range(n + 1)) - set(err.failures))
        if not silent:
            return
        quiet = T("ranks_loaded" if len(silent) > 1 else "rank_loaded", ranks=", ".join(map(str, silent)))
    else:
        quiet = T("every_rank_loaded")
    CheckFailure(check, f"a checkpoint saved by {n} ranks, loaded on {n + 1}", quiet, T("refuse_world_size")).fail()


def _check_torchrun(check: str, load: Callable, load_name: str, tmp: str) -> None:
    n = TORCHRUN_WORLD_SIZE
    where = f"world size {n}, loaded by torchrun"
    try:
        source = textwrap.dedent(inspect.getsource(load))
    except (OSError, TypeError):
        CheckFailure(check, where, T("no_source", name=load_name), T("define_load")).fail()
    script = os.path.join(tmp, "load_under_torchrun.py")
    reports_dir = os.path.join(tmp, "reports")
    os.makedirs(reports_dir, exist_ok=True)
    with open(script, "w") as f:
        f.write(_SCRIPT.format(source=source, name=load.__name__, expected=os.path.join(tmp, f"expected_n{n}"),
                               directory=os.path.join(tmp, f"ckpt_n{n}"), reports=reports_dir))
    proc = start_torchrun(torchrun_command(script, n), cwd=tmp, what=check)
    try:
        _, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        CheckFailure(check, where, T("timeout", timeout=TORCHRUN_TIMEOUT), T("only_files", name=load_name)).fail()
    for rank in range(n):
        path = Path(reports_dir, f"rank{rank}.json")
        if not path.exists():
            CheckFailure(check, where, T("reported_nothing", rank=rank, code=proc.returncode),
                         T("fresh_process", name=load_name), stderr.strip().splitlines()[-6:]).fail()
        report = json.loads(path.read_text())
        if "error" in report:
            CheckFailure(check, where, T("process_raised", rank=rank, error=report["error"]),
                         T("fresh_process_helper", name=load_name)).fail()
        problems = [Message(id_, fields) for id_, fields in report["problems"]]
        if problems:
            CheckFailure(check, where, T("process_differs", rank=rank, problem=problems[0]), T("read_back_exactly"),
                         [str(p) for p in problems[1:6]]).fail()

