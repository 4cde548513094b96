"""DCP checkpoints (fsdp_course/fsdp/dcp.py) under real torchrun: PyTorch's own checkpoint format, both ways.

Two phases of the suite's launches (tests/phases.py):
  - N=2: the layout checked against fully_shard's own `get_model_state_dict` / `get_optimizer_state_dict` (same
    keys, shapes, placements, local shapes, values); ours and fully_shard each train 3 AdamW steps on the same
    data and save (ours through `dcp.save`, fully_shard through torch's get_state_dict + `torch.distributed.
    checkpoint.save`), then take a 4th step: the run that never stopped. Also saved: an SGD-with-momentum
    checkpoint, and the bad ones (a wider model, a model with one more parameter, the course's own sharded format);
  - N=3: every checkpoint is loaded at another world size (2 -> 3), into ours and into fully_shard, and compared
    with what was saved to the bit; the 4th step is taken and compared with the never-stopped run; ours saves at
    N=3 and a 2-rank subgroup of the same launch loads it (3 -> 2, into ours and into fully_shard); each bad
    checkpoint fails on every rank with a message that says what is wrong and what to do, and leaves the model
    unchanged.
The tiny transformer's parameters (vocab 17, d_model 8, 10 classes, in_proj 24 rows) do not divide by 2 or 3 rows
alike, and its flat parameters are padded at both sizes: each cut has uneven chunks and padding.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from phases import launched

STEPS = 3  # AdamW steps before saving: exp_avg, exp_avg_sq and step are not trivial
BATCH = 12  # global batch: 6 rows per rank at N=2, 4 at N=3
LR = 1e-2
# The 4th step after loading at N=3 against the run that never stopped at N=2 (same engine, same global batch). The
# loaded values are equal to the bit, but the gradient is the mean of 3 rank means instead of 2: the last bits of the
# sums differ. Measured (torch 2.13 CPU, ours and fully_shard alike): loss 1.0e-7 relative; after the AdamW step the
# parameters differ by 1.7e-6 of their global norm (Adam turns the rounding noise of gradients that are zero in exact
# arithmetic, attention's key bias, into full-size steps: compared in global norm, as docs/ARCHITECTURE.md says),
# while the step itself moved them by 9.2e-3; with exp_avg_sq loaded as zeros (planted) they differed by 1.8.
TOL_LOSS = 1e-6
TOL_PARAMS = 2e-5


def phase_save(out: Path) -> None:  # in each process of the "pair" launch (tests/phases.py)
    worker("save", out)


def phase_load(out: Path) -> None:  # in each process of the "three" launch, after the "pair" launch saved
    worker("load", out.parent / "dcp_save")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    launched(tmp_path_factory, "dcp_load")  # runs the "pair" launch first
    out = launched(tmp_path_factory, "dcp_save")
    found: dict[str, Any] = {"dir": out, "save": json.loads((out / "save.json").read_text())}
    found["load"] = [json.loads((out / f"load_rank{r}.json").read_text()) for r in range(3)]
    return found


def test_the_layout_is_fully_shards(results: dict[str, Any]) -> None:
    layout = results["save"]["layout"]
    assert layout["model_keys_ours"] == layout["model_keys_torch"]  # same names, same order
    for name, (ours, torch_) in layout["model"].items():
        assert ours == torch_, name  # global shape, placements, local shape on each rank, values to the bit
    assert all(entry[0]["placements"] == ["Shard(dim=0)"] for entry in layout["model"].values())
    # uneven chunks: the embedding's 17 rows are 9 + 8 at N=2
    assert layout["model"]["embedding.weight"][0]["local_shapes"] == [[9, 8], [8, 8]]
    assert layout["optim_state_keys_ours"] == layout["optim_state_keys_torch"]
    for name, (ours, torch_) in layout["optim"].items():
        assert ours == torch_, name  # exp_avg, exp_avg_sq: DTensors Shard(0), same local values; step equal
    assert layout["param_groups_equal"]


def test_saved_directory_is_torchs_format(results: dict[str, Any]) -> None:
    files = results["save"]["files"]
    # one data file per saving rank, and the sha256 of every file (ours, beside them: torch's reader ignores it)
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "fsdp_course_digests.json"]
    assert all(size > 0 for size in files.values())


def assert_exact(loaded: dict[str, Any], what: str) -> None:
    assert loaded["model_equal"], f"{what}: model values differ from what was saved: {loaded['model_diff']}"
    if "optim_equal" in loaded:
        assert loaded["optim_equal"], f"{what}: optimizer state differs from what was saved: {loaded['optim_diff']}"


@pytest.mark.parametrize("case", ["ours2_into_ours3", "ours2_into_torch3", "torch2_into_ours3", "sgd2_into_ours3",
                                  "ours3_into_ours2", "ours3_into_torch2"])
def test_a_checkpoint_loads_at_another_world_size_exactly(results: dict[str, Any], case: str) -> None:
    for rank, report in enumerate(results["load"]):
        if case in report:  # the 3 -> 2 cases run on ranks 0 and 1 only
            assert_exact(report[case], f"rank {rank}, {case}")
    assert case in results["load"][0]


@pytest.mark.parametrize("case", ["ours2_into_ours3", "ours2_into_torch3", "torch2_into_ours3"])
def test_training_continues_as_if_it_never_stopped(results: dict[str, Any], case: str) -> None:
    step = results["load"][0][case]["next_step"]
    assert step["loss_rel"] <= TOL_LOSS, step
    assert step["params_rel"] <= TOL_PARAMS, step
    assert step["moved_rel"] > 100 * TOL_PARAMS, step  # the step did move the parameters


def test_saving_before_the_first_step_or_inside_a_step_changes_nothing(results: dict[str, Any]) -> None:
    early = results["save"]["early"]
    assert early["steps"] == [2.0]  # AdamW's counter after two steps, as if no checkpoint had been taken
    assert early["equal"] == [], early["equal"]  # the parameters to the bit


def test_dim0_chunks_are_torch_chunks() -> None:
    # no torchrun: the cut of a gathered flat parameter, against torch.chunk on dim 0 (empty chunks included)
    import torch

    from fsdp_course.fsdp.dcp import dim0_chunks
    from fsdp_course.fsdp.flat_param import flatten_params

    params = [("a", torch.arange(15.0).reshape(5, 3)), ("b", torch.arange(2.0) + 100), ("c", torch.ones(7, 2))]
    for n in (1, 2, 3, 4, 6):
        layout, flat = flatten_params(params, n)
        for rank in range(n):
            for (name, p), got in zip(params, dim0_chunks(layout, flat, rank, n), strict=True):
                chunks = torch.chunk(p, n, dim=0)
                want = chunks[rank] if rank < len(chunks) else p[:0]  # torch.chunk gives fewer: the rest are empty
                assert torch.equal(got, want), (name, n, rank)


def errors(results: dict[str, Any], case: str) -> list[dict[str, Any]]:
    found = [report["errors"][case] for report in results["load"]]
    for rank, err in enumerate(found):  # every rank raises the same error, nothing changed anywhere
        assert err["type"] == "CheckpointError", (rank, err)
        assert err["message"] == found[0]["message"], rank
        assert err["model_unchanged"], rank
    return found


def test_a_truncated_file_fails_clearly(results: dict[str, Any]) -> None:
    err = errors(results, "truncated")[0]
    assert "is damaged: __0_0.distcp is " in err["message"]
    assert "(truncated). An interrupted save or copy? Copy the checkpoint again or save it again" in err["message"]
    assert err["cause"] is None  # found from the checkpoint's metadata and file sizes, before DCP reads a byte


def test_files_of_two_saves_or_swapped_files_are_named(results: dict[str, Any]) -> None:
    mixed, swapped = errors(results, "mixed")[0]["message"], errors(results, "swapped")[0]["message"]
    assert "is not one save's files: __1_0.distcp is not the file this save wrote (its sha256 differs" in mixed
    assert "__0_0.distcp holds what __1_0.distcp held (the files were swapped or renamed); __1_0.distcp holds " \
           "what __0_0.distcp held" in swapped
    assert "Restore all its files from one save" in mixed


def test_a_second_save_into_a_folder_being_saved_into_is_refused(results: dict[str, Any]) -> None:
    said = results["save"]["locked"]
    assert "another save is writing into" in said and "Save each job into its own folder" in said


def test_a_failed_load_leaves_a_fresh_optimizer_fresh(results: dict[str, Any]) -> None:
    assert all(report["fresh_optimizer_left_without_state"] for report in results["load"])


def test_a_checkpoint_without_a_parameter_fails_clearly(results: dict[str, Any]) -> None:
    err = errors(results, "missing_parameter")[0]
    assert "lacks parameters or buffers this model has: ['extra'] (1)" in err["message"]
    assert err["cause"] is None  # from the metadata, not from DCP's message


def test_a_checkpoint_with_an_extra_parameter_fails_clearly(results: dict[str, Any]) -> None:
    # DCP loads only the keys it is asked for and would ignore 'extra'
    err = errors(results, "extra_parameter")[0]
    assert "holds parameters or buffers this model does not have: ['extra'] (1)" in err["message"]
    assert err["cause"] is None


def test_a_checkpoint_of_another_model_size_fails_clearly(results: dict[str, Any]) -> None:
    err = errors(results, "wrong_shapes")[0]
    assert "was saved from a model of other sizes (embedding.weight: saved (17, 12), this model (17, 8)" in \
        err["message"]
    assert "load it into a model built with the same sizes" in err["message"]
    assert err["cause"] is None


def test_another_optimizer_fails_clearly(results: dict[str, Any]) -> None:
    err = errors(results, "sgd_from_adamw")[0]
    assert "lacks optimizer state this optimizer needs" in err["message"]
    assert "its state has the keys ['exp_avg', 'exp_avg_sq', 'step']" in err["message"]
    assert err["cause"] is None


def test_a_step_that_differs_inside_one_flat_parameter_fails_clearly(results: dict[str, Any]) -> None:
    # the root unit holds fc.weight and fc.bias; fully_shard stepped fc.bias once less: one flat state cannot hold both
    err = errors(results, "step_differs")[0]
    assert "holds different 'step' values for parameters that share one flat parameter here (step 2.0: " \
           "['embedding.weight', 'pos_embedding.weight', 'encoder.norm.weight'] ... (5); step 1.0: ['fc.bias'] (1))" \
           in err["message"], err["message"]
    assert "load the checkpoint into fully_shard, or wrap so that these parameters are in different units" in \
        err["message"]
    assert err["cause"] is None  # DCP loaded it: the limit is this FSDP's


def test_the_courses_sharded_format_cannot_be_resharded(results: dict[str, Any]) -> None:
    err = errors(results, "course_sharded")[0]
    assert "holds no .metadata: not a DCP checkpoint" in err["message"]
    assert "written by save_sharded at world size 2" in err["message"]
    assert "cannot be resharded. Load it with load_sharded at that world size" in err["message"]
    assert err["cause"] == "FileNotFoundError"
    # and the course's own loader refuses the other world size, as it says
    assert "was saved by 2 ranks, this run has 3" in results["load"][0]["course_sharded_own_loader"]


# -- run by torchrun, as the phases dcp_save (N=2) and dcp_load (N=3) of tests/phases.py ------------------------


def worker(phase: str, out: Path) -> None:  # noqa: C901  (one launch, several phases)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as torch_dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from fsdp_course.engines.torch_fsdp import full_state_dict as torch_full_state_dict
    from fsdp_course.engines.torch_fsdp import shard_with_fully_shard
    from fsdp_course.fsdp import dcp
    from fsdp_course.fsdp.api import FSDP
    from fsdp_course.models import TransformerClassifier, TransformerConfig
    from fsdp_course.runtime.context import RankContext

    torch.set_num_threads(1)
    world = RankContext.from_env(timeout=60)
    rank, n = world.rank, world.world_size

    class WithExtra(TransformerClassifier):
        def __init__(self, config: TransformerConfig) -> None:
            super().__init__(config)
            self.extra = nn.Parameter(torch.zeros(5))

    def build(seed: int, cls: type = TransformerClassifier, **sizes: Any) -> nn.Module:
        torch.manual_seed(seed)  # the same values on every rank
        return cls(TransformerConfig.tiny(**sizes))

    def ours(ctx: RankContext, seed: int = 0, sgd: bool = False, **kw: Any) -> tuple[Any, torch.optim.Optimizer]:
        model = FSDP(build(seed, **kw), ctx, wrap={nn.TransformerEncoderLayer})
        opt = (torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9) if sgd
               else torch.optim.AdamW(model.parameters(), lr=LR))
        return model, opt

    def theirs(ctx: RankContext, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = shard_with_fully_shard(build(seed), ctx)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, ctx: RankContext, drop: str = "",
             before_step: Any = None) -> float:
        """One step on global batch i (rank r takes its equal slice); returns the global mean loss. `drop`: a
        parameter whose gradient is dropped before the step (AdamW then skips it: its `step` lags); `before_step()`
        runs between backward and the optimizer's step."""
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randint(0, 17, (BATCH, 64), generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        if drop:
            model.get_parameter(drop).grad = None
        if before_step is not None:
            before_step()
        opt.step()
        return ctx.all_reduce(loss.detach().reshape(1))[0].item() / ctx.world_size

    def full(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model and optimizer as full tensors (collectives), whichever engine."""
        if isinstance(model, FSDP):
            values: dict[str, Any] = {"model": model.full_state_dict()}
            osd = dcp.optimizer_state_dict(model, opt) if opt is not None else None
        else:
            values = {"model": torch_full_state_dict(model)}
            osd = get_optimizer_state_dict(model, opt) if opt is not None else None
        if osd is not None:
            values["optim"] = {name: {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone())  # step: live
                                      for k, v in s.items()} for name, s in osd["state"].items()}
        return values

    def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        """Names whose tensors are not equal to the bit (the whole key set must agree)."""
        if set(a) != set(b):
            return [f"keys {sorted(set(a) ^ set(b))}"]
        out = []
        for k in a:
            if isinstance(a[k], dict):
                out += [f"{k}.{d}" for d in diff(a[k], b[k])]
            elif not torch.equal(a[k], b[k]):
                out.append(f"{k}: max diff {(a[k].double() - b[k].double()).abs().max().item():.3g}")
        return out

    def compare(got: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        report: dict[str, Any] = {"model_diff": diff(got["model"], saved["model"])}
        report["model_equal"] = not report["model_diff"]
        if "optim" in got:
            report["optim_diff"] = diff(got["optim"], saved["optim"])
            report["optim_equal"] = not report["optim_diff"]
        return report

    def global_norm(values: dict[str, torch.Tensor]) -> float:
        return sum(v.double().pow(2).sum() for v in values.values()).sqrt().item()

    def next_step(model: nn.Module, opt: torch.optim.Optimizer, ctx: RankContext, before: dict[str, Any],
                  never_stopped: dict[str, Any]) -> dict[str, float]:
        loss = step(model, opt, STEPS, ctx)
        after = full(model, None)["model"]
        ref = never_stopped["model"]
        return {"loss_rel": abs(loss - never_stopped["loss"]) / abs(never_stopped["loss"]),
                "params_rel": global_norm({k: after[k] - ref[k] for k in ref}) / global_norm(ref),
                "moved_rel": global_norm({k: after[k] - before["model"][k] for k in ref}) / global_norm(ref)}

    def save_torch(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
        msd, osd = get_state_dict(model, opt)
        torch_dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    def load_torch(model: nn.Module, opt: torch.optim.Optimizer, path: Path, group: Any) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        torch_dcp.load(state, checkpoint_id=str(path), process_group=group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def describe(sd: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
        """Per entry: global shape, placements, every rank's local shape and local values (gathered as lists)."""
        out = {}
        for k, v in sd.items():
            if isinstance(v, DTensor):
                local = v.to_local()
                shapes = [None] * ctx.world_size
                values = [None] * ctx.world_size
                dist.all_gather_object(shapes, list(local.shape), group=ctx.group)
                dist.all_gather_object(values, local.tolist(), group=ctx.group)
                out[k] = {"shape": list(v.shape), "placements": [repr(p) for p in v.placements],
                          "local_shapes": shapes, "local_values": values, "dtype": str(v.dtype)}
            else:
                out[k] = {"value": v.tolist() if isinstance(v, torch.Tensor) else v}
        return out

    if phase == "save":
        assert n == 2
        report: dict[str, Any] = {}
        a, a_opt = ours(world)
        b, b_opt = theirs(world)
        msd_a, msd_b = dcp.model_state_dict(a), get_model_state_dict(b)
        layout: dict[str, Any] = {"model_keys_ours": list(msd_a), "model_keys_torch": list(msd_b)}
        da, db = describe(msd_a, world), describe(msd_b, world)
        layout["model"] = {k: (da[k], db.get(k)) for k in da}
        loss_a, loss_b = step(a, a_opt, 0, world), step(b, b_opt, 0, world)
        assert loss_a == loss_b, (loss_a, loss_b)  # N=2: fully_shard and ours step to the bit
        osd_a, osd_b = dcp.optimizer_state_dict(a, a_opt), get_optimizer_state_dict(b, b_opt)
        layout["optim_state_keys_ours"] = {k: sorted(v) for k, v in osd_a["state"].items()}
        layout["optim_state_keys_torch"] = {k: sorted(v) for k, v in osd_b["state"].items()}
        layout["optim"] = {}
        for name in osd_a["state"]:
            da, db = describe(osd_a["state"][name], world), describe(osd_b["state"].get(name, {}), world)
            layout["optim"][name] = (da, db)
        ga, gb = osd_a["param_groups"], osd_b["param_groups"]
        layout["param_groups_equal"] = (len(ga) == len(gb) == 1 and sorted(ga[0]["params"]) == sorted(gb[0]["params"])
                                        and {k: v for k, v in ga[0].items() if k != "params"}
                                        == {k: v for k, v in gb[0].items() if k != "params"})
        report["layout"] = layout
        for i in range(1, STEPS):
            step(a, a_opt, i, world)
            step(b, b_opt, i, world)
        for name, (model, opt) in {"ours2": (a, a_opt), "torch2": (b, b_opt)}.items():
            if name == "ours2":
                dcp.save(model, opt, out / name)
            else:
                save_torch(model, opt, out / name)
            saved = full(model, opt)
            loss = step(model, opt, STEPS, world)  # the run that never stopped
            never_stopped = {"model": full(model, None)["model"], "loss": loss}
            if rank == 0:
                torch.save({"saved": saved, "never_stopped": never_stopped}, out / f"{name}.pt")
        sgd, sgd_opt = ours(world, sgd=True)
        for i in range(STEPS):
            step(sgd, sgd_opt, i, world)
        dcp.save(sgd, sgd_opt, out / "sgd2")
        saved = full(sgd, sgd_opt)
        if rank == 0:
            torch.save({"saved": saved}, out / "sgd2.pt")
        wide, wide_opt = ours(world, d_model=12)
        dcp.save(wide, wide_opt, out / "wide2")
        extra, extra_opt = ours(world, cls=WithExtra)
        dcp.save(extra, extra_opt, out / "extra2")
        a.save_sharded(str(out / "course2"), a_opt)
        skew, skew_opt = theirs(world)  # fully_shard, fc.bias skipped in the 2nd step: steps 2 and 1 in one unit
        step(skew, skew_opt, 0, world)
        step(skew, skew_opt, 1, world, drop="fc.bias")
        save_torch(skew, skew_opt, out / "skew2")
        # a checkpoint taken before the first step, and one between backward and step: nothing else changes
        plain, plain_opt = ours(world)
        saving, saving_opt = ours(world)
        dcp.save(saving, saving_opt, out / "early2")
        for i in range(2):
            step(plain, plain_opt, i, world)
            step(saving, saving_opt, i, world, before_step=lambda i=i: dcp.save(saving, saving_opt, out / f"mid2_{i}"))
        (out / "locked2").mkdir(exist_ok=True)  # another job's save is under way there (its lock file)
        world.barrier()
        if rank == 0:
            (out / "locked2" / dcp.LOCK).write_text("4242\n")
        world.barrier()
        try:
            dcp.save(plain, plain_opt, out / "locked2")
        except dcp.CheckpointError as exc:
            report["locked"] = str(exc)
        report["early"] = {"steps": sorted({float(st["step"]) for st in saving_opt.state.values()}),
                           "equal": diff(full(plain, None), full(saving, None))}
        if rank == 0:
            report["files"] = {f: os.path.getsize(out / "ours2" / f) for f in os.listdir(out / "ours2")}
            (out / "save.json").write_text(json.dumps(report))
        world.barrier()
        world.close()
        return

    assert phase == "load" and n == 3
    report = {"errors": {}}
    refs = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("ours2", "torch2", "sgd2")}

    def loaded_into(kind: str, source: str, ctx: RankContext, seed: int = 1, **kw: Any) -> tuple[Any, Any]:
        model, opt = (ours(ctx, seed=seed, **kw) if kind == "ours" else theirs(ctx, seed=seed))
        if kind == "ours":
            dcp.load(model, opt, out / source)
        else:
            load_torch(model, opt, out / source, ctx.group)
        return model, opt

    for case, kind, source in [("ours2_into_ours3", "ours", "ours2"), ("ours2_into_torch3", "torch", "ours2"),
                               ("torch2_into_ours3", "ours", "torch2")]:
        model, opt = loaded_into(kind, source, world)
        got = full(model, opt)
        report[case] = compare(got, refs[source]["saved"])
        report[case]["next_step"] = next_step(model, opt, world, got, refs[source]["never_stopped"])
        if case == "ours2_into_ours3":
            dcp.save(model, opt, out / "ours3")  # after the 4th step, at N=3
            ours3 = full(model, opt)
    model, opt = loaded_into("ours", "sgd2", world, sgd=True)
    report["sgd2_into_ours3"] = compare(full(model, opt), refs["sgd2"]["saved"])

    # 3 -> 2: a 2-rank world inside this launch (ranks 0 and 1; rank 2 waits)
    pair = dist.new_group([0, 1])
    if rank < 2:
        ctx2 = RankContext(rank, 2, pair, device=world.device)
        for case, kind in [("ours3_into_ours2", "ours"), ("ours3_into_torch2", "torch")]:
            model, opt = loaded_into(kind, "ours3", ctx2, seed=2)
            report[case] = compare(full(model, opt), ours3)
    world.barrier()

    # bad checkpoints: every rank must raise, and the model must stay as it was
    if rank == 0:
        shutil.copytree(out / "ours2", out / "truncated")
        data = (out / "truncated" / "__0_0.distcp").read_bytes()
        (out / "truncated" / "__0_0.distcp").write_bytes(data[: len(data) // 2])
        shutil.copytree(out / "ours2", out / "mixed")  # rank 1's file from another save of the same model
        shutil.copy(out / "early2" / "__1_0.distcp", out / "mixed" / "__1_0.distcp")
        shutil.copytree(out / "ours2", out / "swapped")
        for a, b in (("__0_0.distcp", "tmp"), ("__1_0.distcp", "__0_0.distcp"), ("tmp", "__1_0.distcp")):
            (out / "swapped" / a).rename(out / "swapped" / b)
    world.barrier()
    for case, source, kw in [("truncated", "truncated", {}), ("missing_parameter", "ours2", {"cls": WithExtra}),
                             ("mixed", "mixed", {}), ("swapped", "swapped", {}),
                             ("extra_parameter", "extra2", {}), ("wrong_shapes", "wide2", {}),
                             ("sgd_from_adamw", "ours2", {"sgd": True}), ("course_sharded", "course2", {}),
                             ("step_differs", "skew2", {})]:
        model, opt = ours(world, seed=3, **kw)
        step(model, opt, 0, world)  # a model with optimizer state: a failed load must leave both as they were
        before = full(model, opt)
        try:
            dcp.load(model, opt, out / source)
            err: dict[str, Any] = {"type": None}
        except Exception as exc:  # noqa: BLE001  (recorded, asserted by the tests)
            cause = exc.__cause__
            err = {"type": type(exc).__name__, "message": str(exc),
                   "cause": type(cause).__name__ if cause is not None else None,
                   "cause_message": str(cause) if cause is not None else None}
        err["model_unchanged"] = not diff(full(model, opt), before)
        report["errors"][case] = err
    model, opt = ours(world, seed=3)  # an optimizer that never stepped: load gives it a zero state, and must undo it
    try:
        dcp.load(model, opt, out / "truncated")
    except dcp.CheckpointError:
        report["fresh_optimizer_left_without_state"] = not opt.state
    model, opt = ours(world)
    try:
        model.load_sharded(str(out / "course2"), opt)
    except ValueError as exc:
        report["course_sharded_own_loader"] = str(exc)
    (out / f"load_rank{rank}.json").write_text(json.dumps(report))
    world.barrier()
    world.close()


def test_dcp_inside_run_ranks_says_it_needs_real_processes(tmp_path: Path) -> None:
    from torch import nn

    from fsdp_course import RankError, run_ranks
    from fsdp_course.fsdp import dcp
    from fsdp_course.fsdp.api import FSDP

    base = nn.Linear(4, 2)
    for call in (dcp.save, dcp.load):
        with pytest.raises(RankError, match="DCP checkpoints need real processes.*under torchrun"):
            run_ranks(lambda ctx, call=call: call(FSDP(copy.deepcopy(base), ctx), None, tmp_path), 1)
