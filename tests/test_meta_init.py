"""Piecewise seeded init: a real model and a meta-device model materialized piece by piece agree."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.data import digits_tokens
from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.meta_init import init_weights, materialize, pieces
from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig
from fsdp_course.runtime.simulate import RankError, run_ranks


def meta(config: TransformerConfig) -> TransformerClassifier:
    with torch.device("meta"):
        return TransformerClassifier(config)


def test_pieces_cover_every_parameter_once() -> None:
    model = TransformerClassifier(TransformerConfig.tiny())
    owned = [p for _, piece in pieces(model) for p in piece.parameters()]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))
    assert "encoder.layers.0.self_attn" in dict(pieces(model))


def test_materialize_gives_the_values_of_init_weights() -> None:
    config = TransformerConfig.small()
    real = init_weights(TransformerClassifier(config), seed=7).state_dict()
    got: dict[str, torch.Tensor] = {}
    biggest = 0
    for _, piece in materialize(meta(config), seed=7):
        biggest = max(biggest, sum(t.numel() for t in piece.values()))
        assert not got.keys() & piece.keys()
        got.update(piece)
    assert got.keys() == real.keys()
    for name, value in real.items():
        assert torch.equal(got[name], value), name
    assert biggest < sum(t.numel() for t in real.values()) / 4, "a piece should be a small part of the model"


def test_init_is_seeded_and_independent_of_the_global_rng() -> None:
    config = TransformerConfig.tiny()
    torch.manual_seed(1)
    a = init_weights(TransformerClassifier(config), seed=3).state_dict()
    torch.manual_seed(2)
    b = init_weights(TransformerClassifier(config), seed=3).state_dict()
    c = init_weights(TransformerClassifier(config), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert torch.count_nonzero(a["encoder.layers.0.self_attn.out_proj.bias"]) == 0  # as PyTorch's constructor
    assert torch.equal(a["encoder.layers.0.norm1.weight"], torch.ones_like(a["encoder.layers.0.norm1.weight"]))


def test_a_module_without_reset_parameters_is_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    model = nn.Sequential(MLP([4, 3]), Scale())
    with pytest.raises(TypeError, match="'1' .Scale. owns parameters but has no reset_parameters"):
        init_weights(model, seed=0)


@pytest.mark.parametrize("world_size", [2, 3])  # 3: the flat parameters need padding
def test_our_fsdp_from_the_meta_device_equals_fsdp_from_the_real_model(world_size: int) -> None:
    config, seed = TransformerConfig.tiny(), 5
    real = init_weights(TransformerClassifier(config), seed)
    x, y = (t[:24] for t in digits_tokens())
    wrap = {nn.TransformerEncoderLayer}

    def rank_fn(ctx):
        ours = FSDP(copy.deepcopy(real), ctx, wrap=wrap)
        lazy = FSDP(meta(config), ctx, wrap=wrap, init=lambda m: materialize(m, seed))
        same_shards = [torch.equal(a, b) for a, b in zip(ours.parameters(), lazy.parameters(), strict=True)]
        full = lazy.full_state_dict()
        n, r = ctx.world_size, ctx.rank
        xs, ys = (t[r * len(x) // n : (r + 1) * len(x) // n] for t in (x, y))
        losses = []
        for fsdp in (ours, lazy):  # one AdamW step, then the loss after it
            opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
            F.cross_entropy(fsdp(xs), ys).backward()
            opt.step()
            with torch.no_grad():
                losses.append(F.cross_entropy(fsdp(xs), ys).item())
        return same_shards, full, losses

    expected = real.state_dict()
    for same_shards, full, (loss_real, loss_meta) in run_ranks(rank_fn, world_size, timeout=60):
        assert same_shards and all(same_shards)
        assert full.keys() == expected.keys()
        assert all(torch.equal(full[k], v) for k, v in expected.items())
        assert loss_real == loss_meta


def test_our_fsdp_on_the_meta_device_needs_init() -> None:
    with pytest.raises(RankError, match="ValueError: a module on the meta device has no values: pass init="):
        run_ranks(lambda ctx: FSDP(meta(TransformerConfig.tiny()), ctx), 1)
