"""In Chinese (`FSDP_COURSE_LANG=zh`) the checkers' reports add the Chinese of their hints (`i18n/zh_hints.py`).

The planted mistakes are not copied here: every test of tests/test_checks*.py that runs a checker through
`reference_solutions.fails` is run again, with its own parametrize table, in Chinese, and its report must carry a
`提示：` line in Chinese. Those that launch torchrun are left out (they take tens of seconds each); their hints are
among SAMPLES. Without the variable the same reports stay English. Every pattern of `HINTS` compiles, its template
expands, and each is used by a planted mistake or by an English hint in SAMPLES: no dead patterns.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from fsdp_course.classroom.checks import _common
from fsdp_course.i18n import hint_zh, zh_hints

MODULES = ("test_checks", "test_checks_exercises", "test_checks_zero", "test_checks_wrapping",
           "test_checks_model_pitfalls", "test_checks_mixed_precision", "test_checks_overlap", "test_checks_hsdp",
           "test_checks_lora", "test_checks_budget", "test_checks_dcp", "test_checks_real_fsdp")
SKIP = {  # they launch torchrun (or read a launch's phase), or wait out a Gloo timeout: their hints are in SAMPLES
    "test_checks_exercises.test_checkpoint_loaded_by_torchrun_processes",
    "test_checks_real_fsdp.test_planted_under_torchrun",
    "test_checks.test_ring_deadlock_names_the_send_and_the_step",
}
FIXTURES = {"capsys", "monkeypatch"}
CJK = re.compile(r"[\u4e00-\u9fff]")

# English hints (and problem lines) that the planted mistakes run here do not show: those of the torchrun runs, of
# the tests that do not go through `fails` and of the checkers' rarer branches, written as the checkers write them
SAMPLES = (
    "every rank waited for its send to finish before posting its recv, so no send could finish: per step, start the "
    "send without waiting (work = ctx.group.send([chunk], right, tag)), then ctx.group.recv([incoming], left, "
    "tag).wait(), then work.wait()",
    "rank 1's result is 4x too large: did you sum twice (e.g. an all_reduce on top of the reduce_scatter)?",
    "that is one chunk: all_gather the reduced chunks so every rank holds all of them",
    "same number of elements, different shape: reshape to the input's shape (tensor.shape)",
    "shape differs: pad the flattened input, and cut the padding off the result",
    "keep the input's dtype: pad with tensor.new_zeros(...) rather than torch.zeros(...)",
    "look at the first element that differs, and at which chunk (index // chunk size) it falls in",
    "return the result tensor at the end of your function",
    "the ranks made different calls (or used different shapes): every rank must call the same collectives, with the "
    "same shapes, in the same order",
    "some rank skipped a collective that the others called: every rank must make every call",
    "flatten the tensor with tensor.reshape(-1) before the collectives",
    "read the end of the traceback above: the last line of your code in it is where it went wrong",
    "rank 1 returned NoneType, not a tensor",
    "a send or recv waited for a partner that never came: per step, every rank starts its send (work = "
    "ctx.group.send([chunk], right, tag)), waits for its recv from the left, then waits for the send; rank r sends to "
    "(r + 1) % N and receives from (r - 1) % N, with matching tags",
    "a rank finished while another still waited in a send or recv with it: every send needs the matching recv on its "
    "peer (same tag, same number of elements), and every recv its send",
    "send and recv need contiguous tensors: use the chunks of a 1-D buffer (flat.chunk(n))",
    "a ring all-reduce is N - 1 steps of reduce-scatter, then N - 1 steps of all-gather, one chunk each",
    "unit 0's gradient chunk differs from one process's",
    "unit 1's parameter shard after the step differs from one process's",
    "rank 1's gradient of `fc.weight` differs from one process's",
    "rank 0's `fc.bias` after the step differs from one process's",
    "shard 2 after unscaling differs from one process's",
    "shard 0 after clipping differs from one process's",
    "the output differs from one process's",
    "contributions are missing from a chunk: a recv overwrites its tensor, so in the reduce-scatter half receive into "
    "a separate buffer and add it (chunk.add_(incoming)); each chunk must travel N - 1 steps round the ring, "
    "collecting one contribution per step",
    "contributions are missing from a chunk: a recv overwrites its tensor, so in the reduce-scatter half receive into "
    "a separate buffer and add it (chunk.add_(incoming)); each chunk must travel N - 1 steps round the ring, "
    "collecting one contribution per step; or the all-gather half sent chunks that were not finished: after the "
    "reduce-scatter half, rank r holds the whole sum of chunk (r + 1) % N, the chunk it sends first",
    "a contribution was added twice: in the all-gather half the finished chunks are received into place "
    "(overwriting), not added; and each rank's own chunk is added once",
    "16 elements over 3 ranks: pad with zeros to the next multiple of 3, ceil(16 / 3) * 3 = 18",
    "the flat tensor holds each tensor's values, in order (t.reshape(-1)), then zeros",
    "rank r's shard is [r * s, (r + 1) * s) with s = ceil(numel / N) = 6: equal shards, in rank order, covering the "
    "padded buffer",
    "return views of flat (flat[a:b].view(shape)), not copies",
    "load_sharded runs in a fresh process: it may use only its arguments and os, json, Path, torch (define any "
    "helper inside it)",
    "flatten the bucket's gradients in the order they arrived (torch.cat of each grad.reshape(-1)), pad with zeros at "
    "the end, then reduce-scatter (mean)",
    "fully_shard(layer, mesh=mesh) for every layer, then fully_shard(model, mesh=mesh)",
    "the function runs in fresh processes, where only torch, nn and fully_shard are imported: import anything else it "
    "uses inside the function (the function runs in a fresh process: it may use only its arguments, torch and "
    "fully_shard)",
    "shard every layer, then the model, with the default reshard_after_forward (the root stays gathered, the layers "
    "are gathered again in the backward)",
    "shard exactly the course's units, each with mesh=mesh and no other options",
    "the same forward on every rank: no randomness in forward, no state kept between calls",
)


@dataclass(frozen=True)
class Case:
    """One run of a test of tests/test_checks*.py that plants a mistake: its function and its parameters."""

    id: str
    fn: Callable[..., Any]
    params: tuple[tuple[str, Any], ...]


def _param_sets(fn: Callable[..., Any]) -> list[dict[str, Any]]:
    """The parameters of every run of `fn` that its parametrize marks make."""
    tables = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [getattr(v, "values", v) for v in mark.args[1]]  # a pytest.param's values
        tables.append([dict(zip(names, row if len(names) > 1 else (row,), strict=True)) for row in rows])
    return [dict(itertools.chain.from_iterable(d.items() for d in combo)) for combo in itertools.product(*tables)]


def _cases() -> list[Case]:
    cases = []
    for name in MODULES:
        module = importlib.import_module(name)
        for fname, fn in vars(module).items():
            if not (fname.startswith("test_") and inspect.isfunction(fn) and "fails" in fn.__code__.co_names):
                continue
            if f"{name}.{fname}" in SKIP:
                continue
            for i, params in enumerate(_param_sets(fn)):
                if set(inspect.signature(fn).parameters) - set(params) <= FIXTURES:
                    cases.append(Case(f"{name}.{fname}[{i}]", fn, tuple(params.items())))
    return cases


CASES = _cases()


class _Capture:
    """What `capsys` gives the planted tests: what was printed since the last `readouterr()`."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()

    def readouterr(self) -> SimpleNamespace:
        out = self.buffer.getvalue()
        self.buffer.seek(0)
        self.buffer.truncate()
        return SimpleNamespace(out=out, err="")


def _run(case: Case, language: str | None) -> tuple[list[str], list[str]]:
    """Run the planted test in `language` (None: FSDP_COURSE_LANG unset): the reports that `fails` read, and the
    English lines that the report looked up with hint_zh."""
    reports: list[str] = []
    looked_up: list[str] = []
    module = importlib.import_module(case.fn.__module__)
    original = module.fails

    def fails(*args: Any, **kwargs: Any) -> str:
        out = original(*args, **kwargs)
        reports.append(out)
        return out

    def recording_hint_zh(text: str) -> str | None:
        looked_up.append(text)
        return hint_zh(text)

    capture = _Capture()
    with pytest.MonkeyPatch.context() as mp:
        if language is None:
            mp.delenv("FSDP_COURSE_LANG", raising=False)
        else:
            mp.setenv("FSDP_COURSE_LANG", language)
        mp.setattr(module, "fails", fails)
        mp.setattr(_common, "hint_zh", recording_hint_zh)
        fixtures = {"capsys": capture, "monkeypatch": mp}
        wanted = {k: v for k, v in fixtures.items() if k in inspect.signature(case.fn).parameters}
        with contextlib.redirect_stdout(capture.buffer):
            case.fn(**dict(case.params), **wanted)
    assert reports, f"{case.id} called no checker through fails"
    return reports, looked_up


_IN_CHINESE: dict[str, tuple[list[str], list[str]]] = {}


def _run_in_chinese(case: Case) -> tuple[list[str], list[str]]:
    """`_run(case, "zh")`, once per case: the test of dead patterns reads what the planted tests ran."""
    if case.id not in _IN_CHINESE:
        _IN_CHINESE[case.id] = _run(case, "zh")
    return _IN_CHINESE[case.id]


def test_the_planted_mistakes_are_found() -> None:
    assert len(CASES) > 150
    assert {c.id.split(".")[0] for c in CASES} == set(MODULES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_planted_mistake_gets_a_chinese_hint(case: Case) -> None:
    reports, _ = _run_in_chinese(case)
    for out in reports:
        hints = [line for line in out.splitlines() if line.startswith("  提示：")]
        assert len(hints) == 1 and CJK.search(hints[0]), out
        assert out.index("  hint: ") < out.index("  提示：")
        problems = [line for line in out.splitlines() if line.startswith("  问题：")]
        assert all(CJK.search(line) for line in problems), out


@pytest.mark.parametrize("case", [c for c in CASES if c.id.endswith("[0]")][:6], ids=lambda c: c.id)
def test_without_the_variable_the_report_stays_english(case: Case) -> None:
    reports, _ = _run(case, None)
    for out in reports:
        assert not CJK.search(out), out


def test_every_pattern_compiles_and_its_template_expands() -> None:
    for pattern, template in zh_hints.HINTS:
        compiled = re.compile(pattern, re.DOTALL)
        n = compiled.groups
        fake = re.fullmatch("(x)" * n, "x" * n)  # a match with as many groups as the pattern
        assert fake is not None
        expanded = fake.expand(template)  # an unknown group or a stray backslash raises here
        assert CJK.search(expanded), (pattern, template)
        assert "\\" not in expanded, (pattern, template)
        assert not re.search(r"[，。：；][ ]|[ ][，。：；]", expanded), (pattern, template)  # no space by 。，：


def test_the_samples_translate_with_their_numbers() -> None:
    for sample in SAMPLES:
        zh = hint_zh(sample)
        assert zh is not None and CJK.search(zh), sample
    assert hint_zh("rank 3: values differ") == "rank 3：数值不对"
    assert hint_zh("no padding: 16 elements over 3 ranks: pad with zeros to the next multiple of 3, "
                   "ceil(16 / 3) * 3 = 18").startswith("没有填充：16 个元素分给 3 个 rank")
    assert hint_zh("nothing the course says") is None


def _first_pattern(text: str) -> int | None:
    for i, (pattern, _) in enumerate(zh_hints.HINTS):
        if re.search(pattern, text, re.DOTALL):
            return i
    return None


def test_no_pattern_is_dead() -> None:
    texts = list(SAMPLES)
    for case in CASES:
        texts += _run_in_chinese(case)[1]  # cached: the planted tests above ran them already
    used = {_first_pattern(t) for t in texts}
    dead = [pattern for i, (pattern, _) in enumerate(zh_hints.HINTS) if i not in used]
    assert not dead, dead
