"""`python -m fsdp_course.train`'s four options under real torchrun: --mixed-precision, --prefetch,
--checkpoint-activations, --accumulate.

Nine training runs, each paired with one that differs in one respect:
  - fp32 with options against the plain run: prefetching, recomputing or splitting the batch changes nothing
    the step computes, so the losses agree to the last bits;
  - ours against fully_shard under the same half-precision policy (bf16 with activation checkpointing, fp16 with
    loss scaling, accumulation and prefetching): the same casts and kernels, so the same losses;
  - checkpointing lowers the peak of live tensors (torch's MemTracker, in the summary).
Starting torchrun and importing torch cost most of a launch (about 20 CPU-seconds, against 1-3 for a run), so
the runs share one launch: this file, run by torchrun, calls train.py's `train(parse_args(argv), ctx)` for each
(a fresh RankContext on the same process group: its own ledger), the last through `main(argv)`, the command
line's own path (report, --json, leaving the group). The same launch checks, per engine, that 2 micro-batches
give the gradients of the whole slice (AdamW's losses would not show their scale), and what train.py relies on
torch's ShardedGradScaler for: it unscales fully_shard's DTensor gradients, and an inf on one rank's shard only
skips the step on every rank. The options' parse-time errors are checked without torchrun.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from phases import launched, stdout_of

STEPS = 6
TRAIN = ["--config", "small", "--steps", str(STEPS), "--batch-size", "32", "--log-every", "100", "--timeout", "60"]

# Every run, by name: its options. "plain" is the reference for the fp32 runs of all three engines: at N=2
# fully_shard and the course's DDP give the course's FSDP's losses to the bit (measured at every step; each
# gradient is the mean of two numbers, exact in any order), and tests/test_train.py compares ours with
# fully_shard on its own. The last run goes through main().
RUNS: dict[str, list[str]] = {
    "plain": ["--engine", "ours"],
    "ours_acc_prefetch": ["--engine", "ours", "--accumulate", "2", "--prefetch"],
    "ours_ckpt": ["--engine", "ours", "--checkpoint-activations"],
    "torch_all": ["--engine", "torch", "--accumulate", "2", "--prefetch", "--checkpoint-activations"],
    "ddp_acc_ckpt": ["--engine", "ddp", "--accumulate", "2", "--checkpoint-activations"],
    "ours_bf16": ["--engine", "ours", "--mixed-precision", "bf16", "--checkpoint-activations"],
    "torch_bf16": ["--engine", "torch", "--mixed-precision", "bf16", "--checkpoint-activations"],
    "torch_fp16": ["--engine", "torch", "--mixed-precision", "fp16", "--accumulate", "2", "--prefetch"],
    "ours_fp16": ["--engine", "ours", "--mixed-precision", "fp16", "--accumulate", "2", "--prefetch"],
}

# fp32, the same engine or another, with an option that changes no arithmetic of the step: measured equal to the
# bit at every step but one, step 0 of the --accumulate 2 runs, 1.0e-7 relative (one ulp of 2.3): the loss of a
# step is then summed from two halves. 1e-6 is a few ulps; gradients synchronized after the first micro-batch
# instead of the last moved step 1's loss by 7.9e-4 (planted, measured).
TOL_FP32 = 1e-6
# ours against fully_shard under one half-precision policy. bf16 keeps 8 bits (epsilon 2**-8 = 3.9e-3), fp16 11,
# but both engines cast the same fp32 shards, gather the same halves, run the same kernels and reduce in fp32 (two
# ranks: exact), so they agree to the bit (measured: 0.0 at every step, bf16 and fp16). What a different policy
# does: the bf16 run against its fp32 twin differs by 3e-5 to 2.5e-4 relative per step (measured), fp16 by 3e-7
# to 1.6e-5: the loss is a mean of 16 samples' fp32 log-softmax, in which the roundings average out. 1e-6 is
# 30x below the bf16 difference, and the bytes gathered (below) show the half precision directly.
TOL_HALF = 1e-6
# One step's gradients, whole slice against 2 micro-batches, fp32: measured 3.0e-6 relative (in norm, the worst
# parameter; the same in all three engines: the same sums of 8 and 16 samples). A micro-batch loss not divided
# by K doubles the gradients (an error of 1.0), which AdamW's losses would not show: it ignores their scale.
TOL_GRAD = 3e-5


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run's summary (with its report as "report"), and the scaler claim's per-rank reports as "scaler"."""
    out = launched(tmp_path_factory, "train_features")  # in_torchrun below, in the "pair" launch (tests/phases.py)
    results: dict[str, Any] = {name: json.loads((out / f"{name}.json").read_text()) for name in RUNS}
    last, stdout = list(RUNS)[-1], stdout_of(out)
    results[last]["report"] = stdout[stdout.index("summary: engine="):]  # printed by main()
    for claim in ("scaler", "gradients"):
        results[claim] = [json.loads((out / f"{claim}_rank{r}.json").read_text()) for r in range(2)]
    return results


def assert_losses_agree(a: dict[str, Any], b: dict[str, Any], tol: float, what: str) -> None:
    assert len(a["losses"]) == len(b["losses"]) == STEPS
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert rel(x, y) <= tol, f"{what}, step {step}: {x!r} vs {y!r} ({rel(x, y):.1e} relative)"


def test_accumulation_and_prefetch_change_no_loss(runs: dict[str, Any]) -> None:
    plain = runs["plain"]
    assert_losses_agree(runs["ours_acc_prefetch"], plain, TOL_FP32, "ours --accumulate 2 --prefetch")
    assert_losses_agree(runs["torch_all"], plain, TOL_FP32,
                        "torch --accumulate 2 --prefetch --checkpoint-activations")
    assert_losses_agree(runs["ddp_acc_ckpt"], plain, TOL_FP32, "ddp --accumulate 2 --checkpoint-activations")
    assert plain["losses"][-1] < plain["losses"][0]
    # each micro-batch gathers the parameters again (forward and backward) as a whole step does, but the gradients
    # are reduce-scattered once: 4 Psi (N-1)/N bytes fewer than two steps (fp32, N=2; padding aside). A sync
    # after every micro-batch gives the same gradients, and shows only here.
    for name in ("ours_acc_prefetch", "torch_all"):
        acc, one, psi = runs[name]["bytes_sent_per_step"], plain["bytes_sent_per_step"], plain["params"]
        assert acc == pytest.approx(2 * one - 4 * psi / 2, rel=1e-3), (name, acc, one)


def test_accumulated_gradients_are_the_gradients_of_the_whole_slice(runs: dict[str, Any]) -> None:
    for rank, worst in enumerate(runs["gradients"]):
        assert set(worst) == {"ours", "torch", "ddp"}
        for engine, err in worst.items():
            assert err < TOL_GRAD, f"rank {rank}, {engine}: gradients in 2 micro-batches differ by {err:.1e} (relative)"


def test_checkpointing_activations_changes_no_loss_and_lowers_the_peak(runs: dict[str, Any]) -> None:
    plain, ckpt = runs["plain"], runs["ours_ckpt"]
    assert_losses_agree(ckpt, plain, TOL_FP32, "ours --checkpoint-activations")
    assert ckpt["bytes_sent_per_step"] == plain["bytes_sent_per_step"]  # recomputing gathers nothing more
    # Measured peak live bytes per rank: ours 4.65 MB plain, 3.18 MB with checkpointing (0.68); fully_shard with
    # --accumulate 2 --prefetch 1.86 MB with checkpointing against ours' 2.62 MB without (0.71), the two engines
    # being within 1.1% of each other under the same options (4.65/4.70 MB plain, 2.62/2.60 MB). Without any
    # recomputation the ratio is about 1.
    for with_, without, engine in [(ckpt, plain, "ours"), (runs["torch_all"], runs["ours_acc_prefetch"], "torch")]:
        for rank, (a, b) in enumerate(zip(with_["peak_live_bytes"], without["peak_live_bytes"], strict=True)):
            assert 0 < a < 0.8 * b, f"{engine} rank {rank}: peak live {a} B with checkpointing, {b} B without"


def test_bf16_ours_matches_fully_shard(runs: dict[str, Any]) -> None:
    ours, torch_, fp32 = runs["ours_bf16"], runs["torch_bf16"], runs["ours_ckpt"]
    assert_losses_agree(ours, torch_, TOL_HALF, "bf16 ours vs fully_shard")
    # the policy acts: against the fp32 run with the same options the losses move by more than 10x the tolerance
    assert max(rel(a, b) for a, b in zip(ours["losses"], fp32["losses"], strict=True)) > 10 * TOL_HALF
    # all-gathers of 2-byte parameters, reduce-scatters of 4-byte gradients: about 2/3 of the fp32 bytes
    for run in (ours, torch_):
        assert run["bytes_sent_per_step"] < 0.7 * fp32["bytes_sent_per_step"], run["bytes_sent_per_step"]
        assert run["skipped_steps"] == [] and run["loss_scale"] is None  # bf16 needs no loss scaling


def test_fp16_with_loss_scaling_ours_matches_fully_shard(runs: dict[str, Any]) -> None:
    ours, torch_, fp32 = runs["ours_fp16"], runs["torch_fp16"], runs["ours_acc_prefetch"]
    assert_losses_agree(ours, torch_, TOL_HALF, "fp16 ours vs fully_shard")
    assert ours["skipped_steps"] == torch_["skipped_steps"], (ours["skipped_steps"], torch_["skipped_steps"])
    assert ours["loss_scale"] == torch_["loss_scale"] == 2.0**16  # no step skipped at this size: measured
    for run in (ours, torch_):
        assert run["bytes_sent_per_step"] < 0.7 * fp32["bytes_sent_per_step"], run["bytes_sent_per_step"]
        assert all(math.isfinite(v) for v in run["losses"])


def test_torch_sharded_grad_scaler_works_on_fully_shards_dtensor_gradients(runs: dict[str, Any]) -> None:
    for rank, r in enumerate(runs["scaler"]):
        assert r["grads_are_dtensors"], rank
        # the backward in fp16 of the scaled loss, then unscaled: the plain gradients up to fp16's rounding of the
        # smallest ones, which scaling makes more precise: within fp16's epsilon 2**-11 (measured: 4.4e-7 relative
        # in norm; not unscaled, the error would be 1023, unscaled twice 1 - 2**-10)
        assert r["scaled_over_plain"] == pytest.approx([2.0**10] * len(r["scaled_over_plain"]), rel=2**-11)
        assert r["unscaled_error"] < 2**-11, r["unscaled_error"]
        assert r["clean_step"] == {"stepped": True, "params_moved": True, "scale": 2.0**10}, r["clean_step"]
        # rank 1 alone planted an inf in its shard: every rank skips the step and halves the scale
        assert r["inf_on_rank_1"] == {"stepped": False, "params_moved": False, "scale": 2.0**9}, r["inf_on_rank_1"]


def test_the_summary_records_the_options(runs: dict[str, Any]) -> None:
    keys = ("mixed_precision", "prefetch", "checkpoint_activations", "accumulate")
    assert [runs["plain"][k] for k in keys] == [None, False, False, 1]
    assert [runs["torch_all"][k] for k in keys] == [None, True, True, 2]
    assert [runs["ours_fp16"][k] for k in keys] == ["fp16", True, False, 2]
    assert "mixed precision fp16 (fp32 reduce)  prefetch=on  activation checkpointing=off  micro-batches per " \
           f"step=2  loss scaling: 0 of {STEPS} steps skipped, final scale 65536" in runs["ours_fp16"]["report"]
    assert "fp32  prefetch=off  activation checkpointing=on" in runs["ddp_acc_ckpt"]["report"]


# -- parse-time errors: no torchrun ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--engine", "ddp", "--mixed-precision", "bf16"], "has no parameter-dtype policy. Use --engine ours or "
                                                       "--engine torch"),
    (["--engine", "ddp", "--prefetch"], "gathers nothing, so there is nothing to prefetch. Use --engine ours or "
                                        "--engine torch"),
    (["--batch-size", "30", "--accumulate", "4"], "--accumulate 4: the global batch 30 does not split into 4"),
    (["--accumulate", "0"], "--accumulate: must be a positive integer, got 0"),
    (["--mixed-precision", "fp8"], "argument --mixed-precision: invalid choice: 'fp8'"),
])
def test_options_an_engine_lacks_fail_in_the_parser(argv: list[str], says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_course.train import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2  # argparse's usage error
    assert says in capsys.readouterr().err


def test_options_every_engine_has_pass_the_parser() -> None:
    from fsdp_course.train import parse_args

    for engine in ("ours", "torch", "ddp"):
        args = parse_args(["--engine", engine, "--checkpoint-activations", "--accumulate", "4"])
        assert (args.checkpoint_activations, args.accumulate) == (True, 4)
    args = parse_args(["--engine", "torch", "--mixed-precision", "fp16", "--prefetch"])
    assert (args.mixed_precision, args.prefetch, args.accumulate) == ("fp16", True, 1)


def test_a_rank_slice_that_does_not_split_into_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 splits into 4 micro-batches, but each of 2 ranks gets 6: refused before joining (no process group)
    from fsdp_course.train import join_world, parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        join_world(parse_args(["--batch-size", "12", "--accumulate", "4"]))
    message = str(exit_.value.code)
    assert "each rank's slice of the batch (12 / 2 = 6) does not split into 4 equal micro-batches" in message
    assert "--batch-size 8" in message


# -- run by torchrun, as `torchrun --nproc-per-node 2 tests/test_train_features.py OUTDIR` --------------------------


def scaler_claim(ctx: Any) -> dict[str, Any]:
    """torch's ShardedGradScaler on fully_shard's gradients (DTensors, fp16 compute, fp32 reduce), through
    train.py's LossScaling: unscaled equals unscaled-by-hand, and an inf on rank 1's shard alone skips the step
    on both ranks."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_course.engines.torch_fsdp import full_state_dict
    from fsdp_course.train import LossScaling

    torch.manual_seed(0)  # the same model on both ranks
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))  # each rank its own data
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaling = LossScaling("torch", ctx, init_scale=2.0**10)
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        return model(x).float().pow(2).mean()

    def grads() -> list[torch.Tensor]:
        return [p.grad.full_tensor().clone() for p in params]  # a collective: both ranks

    loss().backward()
    plain = grads()
    optimizer.zero_grad()
    scaling.scale(loss()).backward()
    scaled = grads()
    report: dict[str, Any] = {"grads_are_dtensors": all(isinstance(p.grad, DTensor) for p in params)}
    report["scaled_over_plain"] = [(s / p).item() for s, p in
                                   zip((g.norm() for g in scaled), (g.norm() for g in plain), strict=True)]
    scaling.scaler.unscale_(optimizer)
    report["unscaled_error"] = max(((u - p).norm() / p.norm()).item() for u, p in zip(grads(), plain, strict=True))

    def step() -> dict[str, Any]:
        before = full_state_dict(model)
        stepped = scaling.step(optimizer)
        after = full_state_dict(model)
        return {"stepped": stepped, "params_moved": any(not torch.equal(before[k], after[k]) for k in before),
                "scale": scaling.get_scale()}

    report["clean_step"] = step()
    optimizer.zero_grad()
    scaling.scale(loss()).backward()
    if ctx.rank == 1:
        with torch.no_grad():
            params[0].grad.to_local().view(-1)[0] = float("inf")  # rank 1's shard only
    report["inf_on_rank_1"] = step()
    return report


def accumulation_claim(world: Any) -> dict[str, float]:
    """Per engine, the gradients of one step's batch, taken whole and in 2 micro-batches (train.py's micro_steps):
    the largest relative difference over the parameters, in norm. AdamW, being invariant to the gradients'
    scale, would not show a missing 1/K in the losses; this does."""

    from fsdp_course.data import train_test_split_digits
    from fsdp_course.runtime.context import RankContext
    from fsdp_course.sampler import global_batch, rank_slice
    from fsdp_course.train import CONFIGS, build_engine, micro_steps, parse_args

    x_train, y_train, _, _ = train_test_split_digits("tokens", seed=0)
    idx = rank_slice(global_batch(len(x_train), 32, 0, seed=0), world.rank, world.world_size)
    x, y = x_train[idx], y_train[idx]
    worst = {}
    for engine in ("ours", "torch", "ddp"):
        args = parse_args([*TRAIN, "--engine", engine])
        ctx = RankContext(world.rank, world.world_size, world.group, device=world.device, seed=args.seed)
        built = build_engine(args, ctx, CONFIGS[args.config]())
        grads = []
        for k in (1, 2):
            micro_steps(built, x, y, k, None)
            if engine == "ours":
                grads.append(built.model.full_grads())  # a collective
            else:
                grads.append({n: (p.grad.full_tensor() if engine == "torch" else p.grad).clone()
                              for n, p in built.model.named_parameters()})
            for p in built.params:
                p.grad = None  # what the optimizer's zero_grad() does
        whole, split = grads
        worst[engine] = max(((split[n] - g).norm() / g.norm()).item() for n, g in whole.items() if g.norm() > 0)
    return worst


def in_torchrun(out: Path) -> None:
    import torch

    from fsdp_course.runtime.context import RankContext
    from fsdp_course.train import main, parse_args, report, train

    torch.set_num_threads(1)
    world = RankContext.from_env(timeout=60)
    (out / f"scaler_rank{world.rank}.json").write_text(json.dumps(scaler_claim(world)))
    (out / f"gradients_rank{world.rank}.json").write_text(json.dumps(accumulation_claim(world)))
    *first, last = RUNS
    for name in first:
        if world.rank == 0:
            print(f"RUN {name} {' '.join(RUNS[name])}", file=sys.stderr, flush=True)  # names a traceback's run
        args = parse_args([*TRAIN, *RUNS[name]])
        ctx = RankContext(world.rank, world.world_size, world.group, device=world.device, seed=args.seed)
        summary = train(args, ctx)
        if world.rank == 0:
            (out / f"{name}.json").write_text(json.dumps({**summary, "report": report(summary)}))
    if world.rank == 0:
        print(f"RUN {last} {' '.join(RUNS[last])}", file=sys.stderr, flush=True)
    # the command line's path: joins the group already there, prints the report, writes --json, leaves the group
    main([*TRAIN, *RUNS[last], "--json", str(out / f"{last}.json")])

