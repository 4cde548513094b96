"""Tests for fsdp_course.viz: what each figure contains (rank colours, patches, labels) and the formulas."""

import ast
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from fsdp_course import viz  # noqa: E402
from fsdp_course.fsdp.flat_param import FlatParamLayout  # noqa: E402
from fsdp_course.fsdp.per_param import PerParamLayout  # noqa: E402
from fsdp_course.runtime.ledger import Ledger  # noqa: E402
from fsdp_course.viz.sharding import plot_per_param_sharding  # noqa: E402  (not re-exported by viz yet)


def patches(fig, prefix):
    """Every artist in the figure whose gid starts with `prefix`."""
    return [a for ax in fig.axes for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def mlp_layout(world_size):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    return FlatParamLayout.build(list(m.named_parameters()), world_size)  # 101 elements


# ---------------------------------------------------------------- helpers

@pytest.mark.parametrize("n,text", [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (10 * 2**20, "10.0 MiB"),
                                    (123 * 2**30, "123 GiB"), (1.6e12, "1.46 TiB")])
def test_format_bytes(n, text):
    assert viz.format_bytes(n) == text


def test_rank_colors_are_fixed_and_distinct():
    assert len({viz.rank_color(r) for r in range(10)}) == 10
    assert viz.rank_color(3) == viz.rank_color(13)


def test_figures_show_as_png_without_pyplot():
    png = viz.plot_sharding(["w"], [8], 2)._repr_png_()
    assert png.startswith(b"\x89PNG")


def test_viz_imports_no_jupyter_or_pyplot():
    """The figures import without Jupyter; only widgets.py (never imported by viz/__init__) needs ipywidgets."""
    for path in Path(viz.__file__).parent.glob("*.py"):
        if path.name == "widgets.py":
            continue
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in names if m.split(".")[0] in ("ipywidgets", "IPython") or m == "matplotlib.pyplot"}


# ---------------------------------------------------------------- sharding map

def test_sharding_map_of_a_layout():
    layout = mlp_layout(4)  # 101 -> padded 104, 4 shards of 26
    fig = viz.plot_sharding(layout)
    ranks = patches(fig, "rank")
    assert len(ranks) == 4
    assert [to_hex(p.get_facecolor()) for p in ranks] == [viz.rank_color(r) for r in range(4)]
    assert [(p.get_x(), p.get_width()) for p in ranks] == [(0, 26), (26, 26), (52, 26), (78, 26)]
    pad = patches(fig, "padding")
    assert len(pad) == 2 and all(p.get_hatch() == "///" and p.get_x() == 101 and p.get_width() == 3 for p in pad)
    params = patches(fig, "param:")
    assert [p.get_gid() for p in params] == [f"param:{n}" for n in layout.names]
    assert [p.get_width() for p in params] == [70, 7, 21, 3]
    top = fig.axes[0].child_axes[0]  # the secondary x axis on top carries the names
    assert [t.get_text() for t in top.get_xticklabels()] == layout.names
    assert "101 elements + 3 padding = 4 shards x 26 (104 B per rank)" in fig.axes[0].get_xlabel()


def test_sharding_map_from_plain_data_and_handles():
    fig = viz.plot_sharding(["a", "b", "c"], [5, 100, 3], 3)  # 108: no padding
    assert len(patches(fig, "rank")) == 3 and patches(fig, "padding") == []
    fig = viz.plot_sharding([("a", 0, 5), ("b", 5, 6)], world_size=4, padded_numel=16)
    assert patches(fig, "padding")[0].get_width() == 5

    class Handle:
        layout = mlp_layout(2)

    class Unit:
        label = "layers.0"
        handles = [Handle()]

    fig = viz.plot_sharding(Unit())
    assert "unit 'layers.0'" in fig.axes[0].get_title() and len(patches(fig, "rank")) == 2


def test_sharding_map_says_a_shared_module_path_once():
    fig = viz.plot_sharding(["enc.layers.0.lin.weight", "enc.layers.0.lin.bias", "enc.layers.0.norm.weight"],
                            [12, 3, 3], 2)
    assert "enc.layers.0.*" in fig.axes[0].get_title()
    labels = [t.get_text() for t in fig.axes[0].child_axes[0].get_xticklabels()]
    assert labels == ["lin.weight", "lin.bias", "norm.weight"]


@pytest.mark.parametrize("args,kwargs,match", [
    ((["a", "b"], [1]), {"world_size": 2}, "one numel per name"),
    ((["a"], [4]), {}, "needs world_size"),
    ((["a"], [4], 0), {}, "world_size must be"),
    (([("a", 0, 4), ("b", 2, 4)],), {"world_size": 2}, "overlaps"),
    ((["a"], [5], 2), {"padded_numel": 5}, "multiple of world_size"),
    ((["a"], [0], 2), {}, "empty"),
    (([1, 2],), {"world_size": 2}, "names \\+ numels"),
])
def test_sharding_map_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        viz.plot_sharding(*args, **kwargs)


def test_per_param_sharding_map():
    """Every parameter cut on dim 0 into N chunks of ceil(dim0 / N) rows; each rank's padding rows hatched."""
    named = [("up.weight", torch.zeros(5, 3)), ("up.bias", torch.zeros(5)), ("down.weight", torch.zeros(2, 5)),
             ("down.bias", torch.zeros(3))]
    fig = plot_per_param_sharding(PerParamLayout.build(named, 3))
    for name, _ in named:
        ranks = [p for p in patches(fig, "rank") if p.get_gid().endswith(f":{name}")]
        assert [to_hex(p.get_facecolor()) for p in ranks] == [viz.rank_color(r) for r in range(3)], name
    widths = {p.get_gid(): round(p.get_width() * 3, 6) for p in patches(fig, "rank")}  # share of a rank's chunk
    # up.weight: 5 rows -> 2 per rank, rank 2 holds 1 row; down.weight: 2 rows -> 1 per rank, rank 2 holds none
    assert [widths[f"rank{r}:up.weight"] for r in range(3)] == [1, 1, 0.5]
    assert [widths[f"rank{r}:down.weight"] for r in range(3)] == [1, 1, 0]
    assert [widths[f"rank{r}:down.bias"] for r in range(3)] == [1, 1, 1]
    pad = {p.get_gid(): (round(p.get_x() * 3, 6), round(p.get_width() * 3, 6)) for p in patches(fig, "padding")}
    assert pad == {"padding:up.weight": (2.5, 0.5), "padding:up.bias": (2.5, 0.5), "padding:down.weight": (2, 1)}
    assert all(p.get_hatch() == "///" for p in patches(fig, "padding"))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["up.weight (5, 3)", "up.bias (5,)", "down.weight (2, 5)",
                                                            "down.bias (3,)"]
    right = [t.get_text() for t in ax.child_axes[0].get_yticklabels()]
    assert right == ["(2, 3) per rank, pad 3", "(2,) per rank, pad 1", "(1, 5) per rank, pad 5", "(1,) per rank"]
    assert "33 elements + 9 padding = 3 ranks x 14 (56 B per rank)" in ax.get_xlabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["rank 0", "rank 1", "rank 2", "padding"]


def test_per_param_sharding_map_from_plain_data_and_bad_input():
    fig = plot_per_param_sharding(["enc.a.weight", "enc.a.bias"], [(4, 2), (4,)], 2)  # no padding
    assert patches(fig, "padding") == [] and len(patches(fig, "rank")) == 4
    assert "enc.a.*" in fig.axes[0].get_title()
    for args, match in [((["a"], [(4,)]), "needs world_size"), ((["a", "b"], [(4,)], 2), "one shape per name"),
                        ((["a"], [()], 2), "no rows"), ((["a"], [(4,)], 0), "world_size must be"),
                        (([], [], 2), "nothing to draw")]:
        with pytest.raises(ValueError, match=match):
            plot_per_param_sharding(*args)


# ---------------------------------------------------------------- memory timeline

def fsdp_timeline(rank):
    snap = {"sharded_params": 100, "optimizer": 200 + rank}
    return [("forward: unshard layers.0", {**snap, "gathered_params": 400}), ("forward: reshard layers.0", snap),
            ("pre_backward: unshard layers.0", {**snap, "gathered_params": 400, "grads": 400}),
            ("pre_backward: reduce_scatter layers.0", {**snap, "gathered_params": 400, "sharded_grads": 100}),
            ("pre_backward: reshard layers.0", {**snap, "sharded_grads": 100}), ("optimizer step", snap)]


DDP_TIMELINE = [("backward", {"params": 400, "grads": 400, "optimizer": 800}),
                ("all_reduce gradients", {"params": 400, "grads": 400, "optimizer": 800})]


def test_memory_timeline_stacked_per_rank():
    fig = viz.plot_memory_timeline([fsdp_timeline(0), fsdp_timeline(1), fsdp_timeline(2)])
    assert len(fig.axes) == 3
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["rank 0", "rank 1", "rank 2"]
    bars = patches(fig, "cat:gathered_params")
    assert len(bars) == 3 * 6 and [b.get_height() for b in bars[:6]] == [400, 0, 400, 400, 0, 0]
    lines = fig.axes[0].get_lines()
    kinds = [line.get_label() for line in lines]
    assert kinds.count("unshard") == 2 and kinds.count("reshard") == 2 and kinds.count("reduce_scatter") == 1
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"sharded_params", "gathered_params", "grads", "sharded_grads", "optimizer", "unshard"} <= set(legend)
    assert fig.axes[0].get_ylabel() == "bytes (KiB)"


def test_memory_timeline_lines_use_rank_colours_and_accept_dicts_and_engines():
    class Engine:
        timeline = fsdp_timeline(0)

    fig = viz.plot_memory_timeline({1: fsdp_timeline(1), 0: Engine()}, kind="lines")
    lines = patches(fig, "rank")
    assert [line.get_gid() for line in lines] == ["rank0", "rank1"]
    assert [line.get_color() for line in lines] == [viz.rank_color(0), viz.rank_color(1)]
    assert list(lines[1].get_ydata()) == [301 + 400 * (i in (0, 2, 3)) + 400 * (i == 2) + 100 * (i in (3, 4))
                                          for i in range(6)]
    assert len(viz.plot_memory_timeline(Engine()).axes) == 1  # one engine = one rank


def test_memory_compare_side_by_side_on_one_scale():
    fig = viz.plot_memory_compare({"DDP": [DDP_TIMELINE] * 2, "FSDP": [fsdp_timeline(0), fsdp_timeline(1)]})
    assert [ax.get_title() for ax in fig.axes] == ["DDP", "FSDP"]
    assert fig.axes[0].get_ylim() == fig.axes[1].get_ylim()
    assert len(patches(fig, "rank")) == 3  # DDP's two ranks are equal: one line, labelled with both
    fig = viz.plot_memory_compare({"DDP": [DDP_TIMELINE], "FSDP": [fsdp_timeline(0)]}, kind="stack")
    assert len(patches(fig, "cat:")) > 0


def test_memory_timeline_bad_input():
    with pytest.raises(ValueError, match="empty"):
        viz.plot_memory_timeline([[], []])
    with pytest.raises(ValueError, match="kind"):
        viz.plot_memory_timeline([fsdp_timeline(0)], kind="pie")
    with pytest.raises(ValueError, match="nothing to compare"):
        viz.plot_memory_compare({})
    with pytest.raises(ValueError, match="rank 3"):
        viz.plot_memory_compare({"FSDP": [fsdp_timeline(0)]}, kind="stack", rank=3)


# ---------------------------------------------------------------- traffic

def fsdp_ledger(rank=0, world_size=4, steps=2):
    led = Ledger(rank, world_size)
    led.add("broadcast", 1, "float32", ((1000,),), 4000)
    for s in range(steps):
        led.mark(f"step {s}")
        led.add("all_gather", 2, "float32", ((250,),), 4000)
        led.add("all_gather", 3, "float32", ((250,),), 4000)
        led.add("reduce_scatter", 4, "float32", ((1000,),), 4000)
        led.add("barrier", 5, "float32", (), 0)
    return led


def test_traffic_formula():
    assert viz.traffic_formula(4000, 4) == {"ddp": 6000, "fsdp": 9000}
    assert viz.traffic_formula(4000, 1) == {"ddp": 0, "fsdp": 0}
    with pytest.raises(ValueError):
        viz.traffic_formula(4000, 0)


def test_traffic_bars_match_the_ledger_and_the_3psi_line():
    led = fsdp_ledger()
    fig = viz.plot_traffic(led, 4000, 4)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["(no label)", "step 0", "step 1"]
    ag = [p.get_height() for p in patches(fig, "op:all_gather")]
    rs = [p.get_height() for p in patches(fig, "op:reduce_scatter")]
    assert ag == [0, 6000, 6000] and rs == [0, 3000, 3000]
    assert [ag[i] + rs[i] for i in (1, 2)] == [led.total(label=f"step {i}")[0] for i in (0, 1)]
    formula = {line.get_gid(): line.get_ydata()[0] for line in patches(fig, "formula:")}
    assert formula == {"formula:ddp": 6000, "formula:fsdp": 9000}
    assert ag[1] + rs[1] == formula["formula:fsdp"]  # FSDP moves 3Ψ(N-1)/N per step
    assert not patches(fig, "op:barrier")


def test_traffic_picks_a_rank_and_steps():
    ledgers = [fsdp_ledger(r) for r in range(4)]
    fig = viz.plot_traffic(ledgers, 4000, 4, rank=2, steps=["step 1"])
    assert "rank 2" in fig.axes[0].get_title()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["step 1"]
    fig = viz.plot_traffic(ledgers[0].records, 4000, 4, direction="recv")  # plain records
    assert len(patches(fig, "op:all_gather")) == 3


def test_traffic_bad_input():
    with pytest.raises(ValueError, match="recorded on 4 ranks"):
        viz.plot_traffic(fsdp_ledger(), 4000, 2)
    with pytest.raises(ValueError, match="empty"):
        viz.plot_traffic(Ledger(0, 2), 4000, 2)
    with pytest.raises(ValueError, match="no ledger for rank 5"):
        viz.plot_traffic([fsdp_ledger(r) for r in range(4)], 4000, 4, rank=5)
    with pytest.raises(ValueError, match="direction"):
        viz.plot_traffic(fsdp_ledger(), 4000, 4, direction="both")


# ---------------------------------------------------------------- ZeRO stages

@pytest.mark.parametrize("stage,expected", [("DDP", 16 * 1000), ("ZeRO-1", 8 * 1000 + 8 * 1000 / 8),
                                            ("zero2", 4 * 1000 + 12 * 1000 / 8), ("FSDP", 16 * 1000 / 8)])
def test_zero_bytes_match_the_paper(stage, expected):
    assert viz.zero_bytes(1000, 8, stage)["total"] == pytest.approx(expected)


def test_zero_formula_text():
    assert [viz.zero_formula_text(s) for s in range(4)] == ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]
    assert [viz.zero_formula_text(s, "sgd") for s in range(4)] == ["8Ψ", "8Ψ", "4Ψ + 4Ψ/N", "8Ψ/N"]


def test_zero_bars_formula_and_measured():
    numel, n = 10_000, 4
    measured = {"DDP": {"params": 40_000, "grads": 40_000, "optimizer": 80_000, "buffers": 64},
                "FSDP": 41_000}
    fig = viz.plot_zero_bars(numel, n, measured, highlight="ZeRO-2")
    ax = fig.axes[0]
    for s, name in enumerate(viz.STAGES):
        heights = sum(p.get_height() for p in patches(fig, f"formula:{name}:"))
        assert heights == pytest.approx(viz.zero_bytes(numel, n, s)["total"])
    assert sum(p.get_height() for p in patches(fig, "measured:DDP:")) == 160_064
    assert [p.get_height() for p in patches(fig, "measured:ZeRO-3:")] == [41_000]
    assert patches(fig, "measured:ZeRO-1:") == []
    assert all(p.get_hatch() == "//" for p in patches(fig, "measured:"))
    assert all(p.get_alpha() == 0.35 for p in patches(fig, "formula:DDP:"))
    assert all(p.get_alpha() == 1.0 for p in patches(fig, "formula:ZeRO-2:"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["DDP\n16Ψ", "ZeRO-1\n8Ψ + 8Ψ/N",
                                                            "ZeRO-2\n4Ψ + 12Ψ/N", "ZeRO-3\n16Ψ/N"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["params", "grads", "optimizer", "other", "total", "measured"]
    fig = viz.plot_zero_bars(numel, n, gathered_numel=100)  # formulas only, with FSDP's gathered unit
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["params", "grads", "optimizer",
                                                                           "gathered"]
    assert [p.get_height() for p in patches(fig, "formula:ZeRO-3:gathered")] == [800]


def test_zero_bars_bad_input():
    with pytest.raises(ValueError, match="unknown ZeRO stage"):
        viz.plot_zero_bars(1000, 4, {"ZeRO-4": 1})
    with pytest.raises(ValueError, match="two entries"):
        viz.plot_zero_bars(1000, 4, {"ZeRO-3": 1, "FSDP": 1})
    with pytest.raises(ValueError, match="optimizer"):
        viz.plot_zero_bars(1000, 4, optimizer="lion")
    with pytest.raises(ValueError, match="world_size"):
        viz.zero_bytes(1000, 0, 0)


def test_memory_timeline_names_phases_says_which_ranks_coincide_and_hatches_shards():
    fig = viz.plot_memory_timeline([fsdp_timeline(0)] * 3 + [fsdp_timeline(1)], kind="lines")
    lines = patches(fig, "rank")
    assert [line.get_label() for line in lines] == ["ranks 0, 1, 2 (equal)", "rank 3"]  # one line, said on it
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward", "backward", "optimizer step"]
    events = ("forward done", "backward done", "reduce_scatter bucket 3", "step starts")
    assert [viz.timeline._phase(e) for e in events] == ["forward", "backward", "backward", "step starts"]
    assert [p.get_gid() for p in patches(fig, "phase:")] == ["phase:forward", "phase:backward"]  # shaded runs
    (peak,) = patches(fig, "peak")
    assert peak.get_text() == "peak 1.07 KiB: pre_backward: unshard layers.0"  # the bytes, and the event
    bars = viz.plot_memory_timeline([fsdp_timeline(0)])
    assert {b.get_hatch() for b in patches(bars, "cat:sharded_")} == {"///"}
    assert {b.get_hatch() for b in patches(bars, "cat:gathered_params")} == {None}
