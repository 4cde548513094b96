"""Checker of exercise 08: a sharded checkpoint, saved per rank, loaded back exactly by other processes.

A SHARDED checkpoint (PyTorch FSDP's `StateDictType.SHARDED_STATE_DICT`, arXiv:2304.11277) has
every rank write only what it holds: its flat-parameter shards and its shard of the optimizer
state, plus metadata (the world size) to refuse a mismatched load. No rank ever holds the full model.

The state saved here is real: the course's FSDP engine wraps a tiny Transformer classifier (one
unit per encoder layer) and trains two AdamW steps on simulated ranks; `rank_state` turns one
rank's shards and Adam state into a flat dict of tensors. The learner's `save(ctx, state, dir)`
runs on the simulated ranks (threads); their `load(ctx, dir)` then runs in *other processes*:
`torchrun --nproc-per-node 2` starts two fresh Python processes that join a real Gloo group with
`RankContext.from_env()`, each loads its rank's state and compares it bit for bit with what the
threads saved. The load function travels by its source code (`inspect.getsource`), so it may use
only its arguments and `os`, `json`, `pathlib.Path`, `torch`.
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
    exception_hint,
    not_implemented,
    require_callable,
    require_world_sizes,
    run_checked,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.launch import start_torchrun, torchrun_command
from fsdp_course.runtime.simulate import RankError, run_ranks

__all__ = ["check_sharded_checkpoint", "compare_states", "rank_state", "trained_fsdp"]

WORLD_SIZES = (1, 2, 3)
TORCHRUN_WORLD_SIZE = 2
TORCHRUN_TIMEOUT = 120.0  # seconds: three fresh Python processes importing torch on a busy laptop

T = catalogue("checkpoint", {
    "load_not_dict": ("load returned {kind}, not a dict of tensors", "load 返回了 {kind}，而不是由张量组成的 dict"),
    "keys_differ": ("keys differ: missing {missing}, unexpected {extra}", "键不一致：缺少 {missing}，多出 {extra}"),
    "not_tensor": ("{name}: {kind}, not a tensor", "{name}：是 {kind}，不是张量"),
    "dtype_shape": ("{name}: {got}, saved {saved}", "{name}：得到 {got}，保存的是 {saved}"),
    "values_differ": ("{name}: values differ (max difference {diff:g})", "{name}：数值不同（最大差值 {diff:g}）"),
    "same_names": ("load reads the files save wrote: use the same names (one per rank, plus the metadata)",
                   "load 读取的是 save 写下的文件：使用相同的文件名（每个 rank 一个，外加元数据）"),
    "plain_tensors": ("save plain tensors (a dict of tensors) so that torch.load(..., weights_only=True) can read them",
                      "保存普通张量（由张量组成的 dict），这样 torch.load(..., weights_only=True) 才能读取它们"),
    "state_differs": ("the state loaded back differs from the one saved: {problem}",
                      "读回的状态与保存的不同：{problem}"),
    "save_as_is": ("save every tensor of the dict as it is (torch.save(state, path)) and load the same file back on "
                   "the same rank", "按原样保存 dict 里的每个张量（torch.save(state, path)），并在同一个 rank 上读回"
                   "同一个文件"),
    "no_collective": ("rank {rank} returned from save without any collective",
                      "rank {rank} 从 save 返回时没有做任何集合通信"),
    "end_with_barrier": ("nothing tells a rank that the others have finished writing: end save with ctx.barrier(), so "
                         "that the checkpoint is complete when any rank returns",
                         "没有任何机制让一个 rank 知道其他 rank 已经写完：在 save 末尾调用 ctx.barrier()，"
                         "这样任何一个 rank 返回时，检查点都已完整"),
    "too_few_files": ("the checkpoint directory holds {files} file(s) for {n} ranks",
                      "{n} 个 rank 的检查点目录里只有 {files} 个文件"),
    "own_file": ("each rank writes its own file (e.g. rank{{ctx.rank}}.pt): a sharded checkpoint never gathers the "
                 "state on one rank", "每个 rank 写自己的文件（例如 rank{{ctx.rank}}.pt）：分片检查点从不把状态汇集到"
                 "一个 rank 上"),
    "every_rank_loaded": ("every rank loaded it without an error", "每个 rank 都加载了它，没有报错"),
    "rank_loaded": ("rank {ranks} loaded it without an error", "rank {ranks} 加载了它，没有报错"),
    "ranks_loaded": ("ranks {ranks} loaded it without an error", "rank {ranks} 都加载了它，没有报错"),
    "refuse_world_size": ("save the world size in the metadata; in load, raise (e.g. ValueError) on every rank when it "
                          "differs from ctx.world_size: a sharded checkpoint is cut per world size",
                          "把 world size 存进元数据；load 时若它与 ctx.world_size 不同，就在每个 rank 上抛出异常"
                          "（例如 ValueError）：分片检查点是按 world size 切分的"),
    "no_source": ("the source of {name} cannot be found", "找不到 {name} 的源代码"),
    "define_load": ("define load in a notebook cell or a .py file: torchrun's processes run its source",
                    "在 notebook 的单元格或 .py 文件里定义 load：torchrun 的进程运行的是它的源代码"),
    "timeout": ("torchrun did not finish within {timeout:g} s", "torchrun 没有在 {timeout:g} 秒内结束"),
    "only_files": ("{name} must not wait for anything but the files", "{name} 除了这些文件，不能等待任何别的东西"),
    "reported_nothing": ("rank {rank}'s process reported nothing (torchrun exit code {code})",
                         "rank {rank} 的进程什么也没有报告（torchrun 退出码 {code}）"),
    "fresh_process": ("{name} runs in a fresh process: it may use only its arguments and os, json, Path, torch",
                      "{name} 在一个全新的进程里运行：只能使用它的参数以及 os、json、Path、torch"),
    "fresh_process_helper": ("{name} runs in a fresh process: it may use only its arguments and os, json, Path, torch "
                             "(define any helper inside it)",
                             "{name} 在一个全新的进程里运行：只能使用它的参数以及 os、json、Path、torch"
                             "（要用的辅助函数都定义在它内部）"),
    "process_raised": ("rank {rank}'s process raised {error}", "rank {rank} 的进程抛出了 {error}"),
    "process_differs": ("rank {rank}'s process loaded a different state: {problem}",
                        "rank {rank} 的进程加载的状态与保存的不同：{problem}"),
    "read_back_exactly": ("load must read back exactly what save wrote, in any process",
                          "在任何进程里，load 都必须原样读回 save 写下的内容"),
    # what passed
    "passed_saved": ("  a tiny Transformer under FSDP (one unit per encoder layer), after 2 AdamW steps: every rank's "
                     "shards and Adam state saved and loaded back bit for bit, one file per rank",
                     "  FSDP 下的一个小 Transformer（每个编码器层一个单元），训练 2 步 AdamW 之后：每个 rank 的分片和 "
                     "Adam 状态都保存下来，又逐位不差地加载回来，每个 rank 一个文件"),
    "passed_wrong_size": ("  loading the {n}-rank checkpoint on {m} ranks raised on every rank",
                          "  在 {m} 个 rank 上加载 {n} 个 rank 保存的检查点时，每个 rank 都抛出了异常"),
    "passed_torchrun": ("  {n} processes started by torchrun (RankContext.from_env, a real Gloo group) loaded what the "
                        "threads saved, bit for bit",
                        "  由 torchrun 启动的 {n} 个进程（RankContext.from_env，一个真实的 Gloo 进程组）"
                        "逐位不差地加载了各线程保存的内容"),
})


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


def _from_json(problems: list[list[Any]]) -> list[Message]:
    return [Message(id_, fields) for id_, fields in problems]


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


def _load_hint(exc: BaseException) -> Message:
    if isinstance(exc, FileNotFoundError):
        return T("same_names")
    if "weights_only" in str(exc) or "Unsupported global" in str(exc):
        return T("plain_tensors")
    return exception_hint(exc)


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
                phase[ctx.rank] = f"{save_name}"
                ctx.ledger.clear()
                save(ctx, {k: v.clone() for k, v in state.items()}, directory)
                synced = bool(ctx.ledger.records)
                ctx.barrier()  # the checker's own: every rank has returned from save before any rank loads
                phase[ctx.rank] = f"{load_name}"
                got = load(ctx, directory)
                return [synced, compare_states(got, state)]

            results = run_checked(check, save_name, body, n, lambda r, n=n, p=phase: f"world size {n}, rank {r} "
                                  f"(in {p[r]})", _load_hint)
            _check_results(check, n, results, directory)
        if max(world_sizes) >= 2:
            _check_wrong_world_size(check, load, load_name, tmp, max(world_sizes))
        if torchrun:
            _check_torchrun(check, load, load_name, tmp)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, world_sizes)))),
        T("passed_saved"))
    if max(world_sizes) >= 2:
        say(T("passed_wrong_size", n=max(world_sizes), m=max(world_sizes) + 1))
    if torchrun:
        say(T("passed_torchrun", n=TORCHRUN_WORLD_SIZE))


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
        proc.communicate(timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        CheckFailure(check, where, T("timeout", timeout=TORCHRUN_TIMEOUT), T("only_files", name=load_name)).fail()
    reports = {}
    for rank in range(n):
        path = Path(reports_dir, f"rank{rank}.json")
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    for rank in range(n):
        report = reports.get(rank)
        if report is None:
            CheckFailure(check, where, T("reported_nothing", rank=rank, code=proc.returncode),
                         T("fresh_process", name=load_name), proc.stderr.strip().splitlines()[-6:]).fail()
        if "error" in report:
            CheckFailure(check, where, T("process_raised", rank=rank, error=report["error"]),
                         T("fresh_process_helper", name=load_name)).fail()
        problems = _from_json(report["problems"])
        if problems:
            CheckFailure(check, where, T("process_differs", rank=rank, problem=problems[0]), T("read_back_exactly"),
                         [str(p) for p in problems[1:6]]).fail()

