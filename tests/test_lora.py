"""LoRA (fsdp_course/lora.py, arXiv:2106.09685): a frozen base with low-rank adapters, fine-tuned under the course's
FSDP and under torch's fully_shard.

- At init the adapted model computes exactly the base model (B = 0); bad input fails with a message.
- `nn.MultiheadAttention` never calls its `out_proj` (checked in torch), which is why `add_lora` refuses it.
- FSDP (wrap={nn.TransformerEncoderLayer}) at N = 2 and 3 against one process on the same global batches, AdamW,
  through the equivalence harness (tolerances of tests/test_fsdp.py), for LoRA and for full fine-tuning of the same
  model: gradients exist only for the adapters and the head, the frozen base stays bit-identical on every rank, and
  the memory per rank and the traffic meet formulas derived from the parameter counts, to the byte.
- fully_shard under torchrun (ONE launch, 2 processes, this file run by torchrun): the same LoRA fine-tuning, with
  losses equal to ours and to one process within tests/test_train.py's tolerance.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from phases import launched
from torch import nn

from fsdp_course import run_ranks
from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.equivalence import (
    ADAMW,
    Case,
    Trainee,
    check_equivalence,
    digits_batches,
    local_slice,
    one_process,
)
from fsdp_course.fsdp.api import FSDP
from fsdp_course.lora import LoRALinear, add_lora, lora_modules, merge_lora, remove_lora
from fsdp_course.memory import attach, measure
from fsdp_course.models import TransformerClassifier, TransformerConfig, count_parameters

STEPS, BATCH, TOL = 5, 24, 1e-5  # tests/test_fsdp.py's: 24 divides by 2 and 3; tests/test_train.py's TOL too
RANK, ALPHA = 2, 4.0
WRAP = {nn.TransformerEncoderLayer}


@functools.cache
def models() -> tuple[nn.Module, nn.Module]:
    """The base model (tiny Transformer, seed 0) and its LoRA copy: adapters on the feed-forward, the head trainable.
    Built without touching the global RNG's state afterwards (the adapters draw from their own generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = TransformerClassifier(TransformerConfig.tiny())
    lora = copy.deepcopy(base)
    add_lora(lora, rank=RANK, alpha=ALPHA, trainable="fc", generator=torch.Generator().manual_seed(1))
    return base, lora


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return digits_batches("tokens", STEPS, BATCH, token_stride=4)  # 16 tokens, labels 0-9


def padded(n: int, world_size: int) -> int:
    return math.ceil(n / world_size) * world_size


def unit_sizes(model: nn.Module, world_size: int) -> dict[str, tuple[int, int]]:
    """Per FSDP unit (each encoder layer, and the root for the rest): (trainable, frozen) elements, each padded to
    a multiple of the world size, derived from the parameters' names alone (not from the engine)."""
    sizes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        unit = ".".join(parts[:3]) if name.startswith("encoder.layers.") else "root"
        sizes.setdefault(unit, [0, 0])[0 if p.requires_grad else 1] += p.numel()
    return {u: (padded(t, world_size), padded(f, world_size)) for u, (t, f) in sizes.items()}


# ------------------------------------------------------------------------------------------------ the module
@pytest.mark.parametrize("config", [TransformerConfig.tiny(), TransformerConfig.small()])
def test_the_adapted_model_computes_exactly_the_base_model_at_init(config: TransformerConfig) -> None:
    torch.manual_seed(0)
    base = TransformerClassifier(config)
    lora = copy.deepcopy(base)
    names = add_lora(lora, rank=RANK, alpha=ALPHA, trainable="fc")
    assert names == [f"encoder.layers.{i}.{n}" for i in range(config.num_layers) for n in ("linear1", "linear2")]
    tokens = torch.randint(0, config.vocab_size, (5, config.max_len), generator=torch.Generator().manual_seed(2))
    for mode in (True, False):  # train and eval: the same kernels for this model (batch_first=False)
        base.train(mode)
        lora.train(mode)
        assert torch.equal(lora(tokens), base(tokens)), f"train={mode}"
    assert all(not m.lora_B.any() and m.lora_A.abs().sum() > 0 for m in lora_modules(lora).values())
    d, ff = config.d_model, config.dim_feedforward
    adapters = config.num_layers * 2 * RANK * (d + ff)  # linear1: A (r, d), B (ff, r); linear2: A (r, ff), B (d, r)
    head = d * config.num_classes + config.num_classes
    assert count_parameters(lora, trainable_only=True) == adapters + head
    assert count_parameters(lora) == count_parameters(base) + adapters
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert all(n.startswith("fc.") or ".lora_" in n for n in trainable), trainable


@pytest.mark.parametrize("kwargs, error, says", [
    (dict(rank=0, alpha=1.0), ValueError, "rank must be a positive integer, got 0"),
    (dict(rank=-2, alpha=1.0), ValueError, "rank must be a positive integer, got -2"),
    (dict(rank=1.5, alpha=1.0), ValueError, "rank must be a positive integer, got 1.5"),
    (dict(rank=True, alpha=1.0), ValueError, "rank must be a positive integer, got True"),
    (dict(rank=2, alpha=float("nan")), ValueError, "alpha must be a finite number"),
    (dict(rank=2, alpha=0), ValueError, "alpha=0 scales the adapters' output by alpha / rank = 0"),
    (dict(rank=9, alpha=1.0), ValueError, "rank 9 exceeds min(in_features, out_features) = 8"),
    (dict(rank=2, alpha=1.0, targets="linear3"), ValueError,
     "target 'linear3' matches no module of this TransformerClassifier; its nn.Linear modules are named "
     "['fc', 'linear1', 'linear2', 'out_proj']"),
    (dict(rank=2, alpha=1.0, targets=()), ValueError, "targets is empty"),
    (dict(rank=2, alpha=1.0, targets="out_proj"), ValueError,
     "'encoder.layers.0.self_attn.out_proj' is inside an nn.MultiheadAttention, which never calls it"),
    (dict(rank=2, alpha=1.0, targets="norm1"), TypeError, "matches 'encoder.layers.0.norm1', a LayerNorm"),
    (dict(rank=2, alpha=1.0, trainable="head"), ValueError, "trainable 'head' matches no module"),
])
def test_bad_input_fails_clearly_and_changes_nothing(kwargs: dict, error: type, says: str) -> None:
    base, _ = models()
    model = copy.deepcopy(base)
    with pytest.raises(error) as raised:
        add_lora(model, **kwargs)
    assert says in str(raised.value)
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters()), "nothing changed"


def test_adapting_twice_and_adapting_a_non_linear_fail() -> None:
    _, lora = models()
    with pytest.raises(ValueError, match="'encoder.layers.0.linear1' already has LoRA adapters"):
        add_lora(copy.deepcopy(lora), rank=2, alpha=1.0)
    with pytest.raises(TypeError, match="LoRALinear adapts an nn.Linear, got LayerNorm"):
        LoRALinear(nn.LayerNorm(4), 1, 1.0)  # type: ignore[arg-type]


def test_a_second_call_adds_adapters_and_keeps_the_first_calls_trainable() -> None:
    base, _ = models()
    model = copy.deepcopy(base)
    add_lora(model, rank=2, alpha=4.0, targets="linear1", trainable="fc")
    first = {n for n, p in model.named_parameters() if p.requires_grad}
    add_lora(model, rank=2, alpha=4.0, targets="linear2")
    now = {n for n, p in model.named_parameters() if p.requires_grad}
    assert first <= now and any("linear1.lora_A" in n for n in first) and any(n.startswith("fc.") for n in first)
    assert {n for n in now - first} == {n for n in now if "linear2.lora_" in n} != set()


@pytest.mark.parametrize("wrap", ["FSDP", "DDP"])
def test_adapting_a_wrapped_model_is_refused_with_the_right_order(wrap: str) -> None:
    base, _ = models()

    def fn(ctx):
        model = copy.deepcopy(base)
        engine = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer}) if wrap == "FSDP" else DDP(model, ctx)
        for target in (engine, model):  # the wrapper, or the model inside it
            said = rf"add_lora after wrapping: .* is (a wrapper \(|wrapped by ){wrap}"
            with pytest.raises(ValueError, match=said) as raised:
                add_lora(target, rank=2, alpha=4.0, trainable="fc")
            assert "add_lora(model, ...); fsdp = FSDP(model, ctx, ...)" in str(raised.value)
        assert not lora_modules(model)

    run_ranks(fn, 2)


def test_multihead_attention_never_calls_out_proj() -> None:
    """Why add_lora refuses attention: nn.MultiheadAttention hands out_proj's weight and bias to
    F.multi_head_attention_forward; out_proj's own forward never runs. A LoRALinear planted there by hand has no
    .weight, and the forward fails (a LoRALinear that exposed its base's weight would be skipped silently)."""
    base, _ = models()
    model = copy.deepcopy(base)
    calls = []
    for layer in model.encoder.layers:
        layer.self_attn.out_proj.register_forward_hook(lambda *_: calls.append(1))
        layer.linear1.register_forward_hook(lambda *_: calls.append(2))
    model(torch.zeros(2, 8, dtype=torch.long))
    assert calls == [2, 2], "linear1 is called in every layer, out_proj in none"
    layer = model.encoder.layers[0]
    layer.self_attn.out_proj = LoRALinear(layer.self_attn.out_proj, 2, 1.0)  # what add_lora refuses to do
    with pytest.raises(AttributeError, match="'LoRALinear' object has no attribute 'weight'"):
        model(torch.zeros(2, 8, dtype=torch.long))


def test_merge_and_remove_after_training() -> None:
    """Train adapters only (head frozen too) for a few steps on one process; merging folds B A into the weight (equal
    up to rounding), removing the adapters gives the base model back bit for bit."""
    base, _ = models()
    model = copy.deepcopy(base)
    add_lora(model, rank=RANK, alpha=ALPHA, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x = batches()[0][0]
    adapted = model(x).detach()
    assert (adapted - base(x)).abs().max() > 1e-3, "the adapters changed the model"
    merged, names = copy.deepcopy(model), list(lora_modules(model))
    assert merge_lora(merged) == names == [f"encoder.layers.{i}.{n}" for i in range(2) for n in ("linear1", "linear2")]
    assert not lora_modules(merged) and count_parameters(merged) == count_parameters(base)
    assert all(not p.requires_grad for p in merged.parameters())
    assert ((merged(x) - adapted).norm() / adapted.norm()).item() < 1e-5
    assert remove_lora(model) == names
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), base.state_dict().values(), strict=True))
    assert torch.equal(model(x), base(x))


# ------------------------------------------------------------------------------------------------ the course's FSDP
class RecordingTrainee(Trainee):
    """`Trainee.fsdp` with a memory recorder, and, after every step: the bytes alive by category, the step's peak
    (by category, as "peak_<category>"), which shards have optimizer state and .grad."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = attach(self.engine, self.optimizer)

    def memory(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(measure(self.engine, self.optimizer))
        out |= {f"peak_{k}": v for k, v in self.recorder.peak.items()}
        out["peak_total"], out["peak_label"] = self.recorder.peak_total, self.recorder.peak_label
        shards = [h.shard for h in self.engine.handles]
        out["with_state"] = [bool(self.optimizer.state.get(s)) for s in shards]
        out["with_grad"] = [s.grad is not None for s in shards]
        out["trainable"] = [s.requires_grad for s in shards]
        self.recorder.reset()
        return out


def make_trainee(model: nn.Module, ctx: Any, optimizer_factory: Any) -> Trainee:
    return RecordingTrainee.fsdp(FSDP(model, ctx, wrap=WRAP),  # AdamW on the trainable shards only
                                 lambda params: optimizer_factory([p for p in params if p.requires_grad]))


@functools.cache
def fsdp_runs(world_size: int) -> dict[str, Any]:
    base, lora = models()
    cases = [Case("lora", lora, ADAMW, batches(), "global_norm"), Case("full", base, ADAMW, batches(), "global_norm")]
    return check_equivalence(cases, make_trainee, world_size, tol=TOL, timeout=60)  # raises on a mismatch


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_fine_tuning_equals_one_process(world_size: int) -> None:
    """Loss and every averaged gradient at each step within 1e-5 relative, parameters within 1e-5 in global norm
    (and elementwise where the gradient is more than rounding noise): check_equivalence asserts it. Measured: loss
    1e-7, gradients 8e-7, parameters 8e-7 (LoRA) and 3e-6 (full) relative."""
    results = fsdp_runs(world_size)
    for result in results.values():
        assert max(result.errors.values()) <= TOL, result.errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_the_adapters_and_the_head_get_gradients_and_optimizer_state(world_size: int) -> None:
    _, lora = models()
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora.named_parameters() if ".lora_" in n or n.startswith("fc.")}
    traces = fsdp_runs(world_size)["lora"].traces
    for step in range(STEPS):
        assert set().union(*(t.grads[step] for t in traces)) == trainable, step
        for rank, trace in enumerate(traces):
            mem = trace.memory[step]
            assert mem["trainable"] == [True, False] * 3, "per unit (root, 2 layers): a trainable, a frozen flat param"
            assert mem["with_grad"] == mem["with_state"] == mem["trainable"], (step, rank, mem)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_frozen_base_is_bit_identical_after_training_on_every_rank(world_size: int) -> None:
    base, lora = models()
    results = fsdp_runs(world_size)
    initial = dict(lora.named_parameters())
    frozen = [n for n, p in lora.named_parameters() if not p.requires_grad]
    for rank, trace in enumerate(results["lora"].traces):
        for step in range(STEPS):
            for name in frozen:
                for start, end, values in trace.params[step].get(name, []):
                    assert torch.equal(values, initial[name].detach().reshape(-1)[start:end]), (rank, step, name)
        held = {n for n in frozen if trace.params[-1].get(n)}
        assert held, f"rank {rank} holds part of the frozen base"
    # and the adapters did train: every B moved off zero (its pieces, put together over the ranks)
    for name in (n for n in initial if n.endswith("lora_B")):
        pieces = [values for t in results["lora"].traces for _, _, values in t.params[-1].get(name, [])]
        assert any(values.abs().sum() > 0 for values in pieces), name
    # full fine-tuning moves the base's weights
    assert any(not torch.equal(values, dict(base.named_parameters())[n].detach().reshape(-1)[s:e])
               for t in results["full"].traces for n, pieces in t.params[-1].items() for s, e, values in pieces)


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_per_rank_meets_the_formula(world_size: int) -> None:
    """After each step, per rank (fp32, AdamW; T trainable and F frozen elements, each unit's flat parameters padded
    to a multiple of N):  shards 4 (T + F) / N,  sharded gradients 4 T / N,  Adam 8 T / N + 4 per trainable flat
    parameter (its step count),  nothing gathered. Full fine-tuning of the same model: T = all, F = 0, ZeRO-3's
    16 Psi / N. The peak comes when the first layer's gradient is ready (encoder.layers.0, the last unit of the
    backward): the root and that layer gathered whole (the frozen weights too: LoRA gathers as much as full
    fine-tuning, plus its adapters), that layer's full trainable gradient, the other layer's sharded gradient."""
    n = world_size
    base, lora = models()
    for name, model in (("lora", lora), ("full", base)):
        sizes = unit_sizes(model, n)
        t, f = sum(s[0] for s in sizes.values()), sum(s[1] for s in sizes.values())
        flat_trainable = sum(1 for s in sizes.values() if s[0])
        after_step = {"sharded_params": 4 * (t + f) // n, "gathered_params": 0, "grads": 0,
                      "sharded_grads": 4 * t // n, "optimizer": 8 * t // n + 4 * flat_trainable, "buffers": 0}
        root, first, other = sizes["root"], sizes["encoder.layers.0"], sizes["encoder.layers.1"]
        peak = {"sharded_params": 4 * (t + f) // n, "gathered_params": 4 * (sum(root) + sum(first)),
                "grads": 4 * first[0], "sharded_grads": 4 * other[0] // n, "optimizer": after_step["optimizer"]}
        for rank, trace in enumerate(fsdp_runs(n)[name].traces):
            for step in range(1, STEPS):  # from the second step on: Adam's state exists at the peak
                mem = trace.memory[step]
                assert {k: mem[k] for k in after_step} == after_step, (name, rank, step)
                assert mem["peak_label"] == "post_backward: grads ready encoder.layers.0", (name, mem["peak_label"])
                assert mem["peak_total"] == sum(peak.values()), (name, rank, step, mem, peak)
    lora_mem, full_mem = (fsdp_runs(2)[k].traces[0].memory[-1] for k in ("lora", "full"))
    kept = ("sharded_params", "sharded_grads", "optimizer")
    # measured at N = 2 (bytes): LoRA 5636 + 820 + 1652 = 8108, full 4996 + 4996 + 10004 = 19996
    assert sum(lora_mem[k] for k in kept) < 0.45 * sum(full_mem[k] for k in kept)
    assert lora_mem["peak_gathered_params"] > full_mem["peak_gathered_params"], "the adapters are gathered too"


@pytest.mark.parametrize("world_size", [2, 3])
def test_lora_shrinks_the_reduce_scatter_not_the_all_gather(world_size: int) -> None:
    """Ring model, per rank and step: every unit's flat parameters are gathered in forward and again in backward,
    frozen ones included, 2 * 4 (T + F)(N - 1)/N bytes sent; only the trainable ones are reduce-scattered,
    4 T (N - 1)/N."""
    n = world_size
    base, lora = models()
    for name, model in (("lora", lora), ("full", base)):
        sizes = unit_sizes(model, n)
        t, f = sum(s[0] for s in sizes.values()), sum(s[1] for s in sizes.values())
        for trace in fsdp_runs(n)[name].traces:
            for sent in trace.sent:
                assert sent["all_gather"] == pytest.approx(2 * 4 * (t + f) * (n - 1) / n, rel=1e-12)
                assert sent["reduce_scatter"] == pytest.approx(4 * t * (n - 1) / n, rel=1e-12)


# ------------------------------------------------------------------------------------------------ fully_shard
@pytest.fixture(scope="module")
def torchrun_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = launched(tmp_path_factory, "lora")  # in_torchrun below, in the "pair" launch (tests/phases.py)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_fully_shard_fine_tunes_lora_as_ours_and_one_process_do(torchrun_reports: list[dict[str, Any]]) -> None:
    _, lora = models()
    reference = one_process(lora, batches(), ADAMW).losses
    for engine in ("ours", "torch"):
        mean = [sum(r[engine]["losses"][s] for r in torchrun_reports) / 2 for s in range(STEPS)]
        for step, (got, ref) in enumerate(zip(mean, reference, strict=True)):
            assert abs(got - ref) <= TOL * abs(ref), f"{engine}, step {step}: {got!r} vs one process {ref!r}"
    for rank, report in enumerate(torchrun_reports):
        for step, (a, b) in enumerate(zip(report["ours"]["losses"], report["torch"]["losses"], strict=True)):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank}, step {step}: ours {a!r} vs fully_shard {b!r}"
        assert report["ours"]["frozen_unchanged"] and report["torch"]["frozen_unchanged"], rank
        assert report["ours"]["adapters_moved"] and report["torch"]["adapters_moved"], rank


def test_fully_shard_keeps_frozen_and_trainable_in_one_group(torchrun_reports: list[dict[str, Any]]) -> None:
    """What torch's FSDP2 does with a mix: one FSDPParamGroup per fully_shard call holds both; the frozen parameters
    are all-gathered in the group's one all-gather with the trainable ones, and only parameters with a gradient are
    reduce-scattered: frozen ones keep .grad None (the dtype rule: tests/test_torch_claims.py)."""
    _, lora = models()
    for rank, report in enumerate(torchrun_reports):
        torch_ = report["torch"]
        assert torch_["groups"] == [[True, False]] * 3, "each group (2 layers, the root) holds trainable and frozen"
        assert torch_["frozen_grads"] == [] and torch_["trainable_grads_are_dtensors"], rank
        # per step: one all-gather per group (the root's in forward only: fully_shard keeps its root gathered until
        # backward), one reduce-scatter per group, of the parameters that have a gradient
        assert torch_["calls"] == {"all_gather": 5, "reduce_scatter": 3}, torch_["calls"]
        layers, root = torch_["padded_numel"]["layer"], torch_["padded_numel"]["root"]
        assert torch_["all_gather_payload"] == 4 * (2 * 2 * sum(layers) + sum(root)), torch_
        assert torch_["reduce_scatter_payload"] == 4 * (2 * layers[0] + root[0]), torch_
    trainable = count_parameters(lora, trainable_only=True)
    assert trainable <= torchrun_reports[0]["torch"]["reduce_scatter_payload"] // 4 < trainable + 50  # padding


# ------------------------------------------------------------------------------------------------ run by torchrun
def fine_tune(model: nn.Module, params: list[nn.Parameter], rank: int, world_size: int,
              after_backward: Any = None) -> list[float]:
    optimizer = ADAMW([p for p in params if p.requires_grad])
    losses = []
    for step, batch in enumerate(batches()):
        x, y = local_slice(batch, rank, world_size)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def in_torchrun(out: Path) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fsdp_course.engines.torch_fsdp import count_collectives, full_state_dict, shard_with_fully_shard
    from fsdp_course.runtime.context import RankContext

    torch.set_num_threads(1)
    world = RankContext.from_env(timeout=60)
    _, lora = models()
    initial = {k: v.clone() for k, v in lora.state_dict().items()}
    frozen = [n for n, p in lora.named_parameters() if not p.requires_grad]
    adapters = [n for n in initial if n.endswith("lora_B")]
    report: dict[str, Any] = {}

    def summary(state: dict[str, torch.Tensor]) -> dict[str, bool]:
        return {"frozen_unchanged": all(torch.equal(state[n], initial[n]) for n in frozen),
                "adapters_moved": all(state[n].abs().sum() > 0 for n in adapters)}

    ours = FSDP(copy.deepcopy(lora), world, wrap=WRAP)
    report["ours"] = {"losses": fine_tune(ours, list(ours.parameters()), world.rank, world.world_size),
                      **summary(ours.full_state_dict())}

    ctx = RankContext(world.rank, world.world_size, world.group, device=world.device)  # a fresh ledger
    model = shard_with_fully_shard(copy.deepcopy(lora), ctx)
    groups = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model] + [model]  # root last
    param_groups = [g._get_fsdp_state()._fsdp_param_group for g in groups]
    found: dict[str, Any] = {"frozen_grads": [], "trainable_grads_are_dtensors": True}

    def after_backward(step: int) -> None:
        for name, p in model.named_parameters():
            if not p.requires_grad and p.grad is not None:
                found["frozen_grads"].append(name)
            elif p.requires_grad and not isinstance(p.grad, DTensor):
                found["trainable_grads_are_dtensors"] = False

    ledger_start = len(ctx.ledger.records)
    with count_collectives(ctx):
        losses = fine_tune(model, list(model.parameters()), ctx.rank, ctx.world_size, after_backward)
    records = ctx.ledger.records[ledger_start:]
    per_step = {op: [r for r in records if r.op == op] for op in ("all_gather", "reduce_scatter")}

    def padded_numel(group: Any) -> tuple[int, int]:  # (trainable, frozen): each parameter's dim 0 padded
        sizes = [0, 0]
        for fp in group.fsdp_params:
            shape = fp._orig_size
            sizes[0 if fp.sharded_param.requires_grad else 1] += padded(shape[0], ctx.world_size) * \
                math.prod(shape[1:])
        return sizes[0], sizes[1]

    numels = [padded_numel(g) for g in param_groups]
    report["torch"] = {
        "losses": losses, **summary(full_state_dict(model)), **found,
        "groups": [sorted({fp.sharded_param.requires_grad for fp in g.fsdp_params}, reverse=True)
                   for g in param_groups],
        "calls": {op: len(rs) // STEPS for op, rs in per_step.items()},
        "all_gather_payload": sum(r.payload_bytes for r in per_step["all_gather"]) // STEPS,
        "reduce_scatter_payload": sum(r.payload_bytes for r in per_step["reduce_scatter"]) // STEPS,
        "padded_numel": {"layer": list(numels[0]), "root": list(numels[-1])},
    }
    assert len(groups) == 3 and numels[0] == numels[1], "two layers' groups, then the root's"
    (out / f"rank{world.rank}.json").write_text(json.dumps(report))
    world.close()


def test_the_encoder_layers_inference_fast_path_fails_loudly_with_an_adapter() -> None:
    """nn.TransformerEncoderLayer's inference fast path (eval, batch_first=True, no grad) reads linear1.weight itself
    instead of calling linear1: with a LoRALinear there it fails loudly, never silently skipping the adapter. The
    course's models use batch_first=False, which never takes that path (the adapted layer runs)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    for batch_first in (True, False):
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
        add_lora(layer, rank=2, alpha=4.0, targets=("linear1", "linear2"))
        layer.eval()
        with torch.no_grad():
            if batch_first:
                with pytest.raises(AttributeError, match="weight"):
                    layer(x)
            else:
                assert layer(x).shape == x.shape
