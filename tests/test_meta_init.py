"""Piecewise seeded init: a real model and a meta-device model materialized piece by piece agree."""

import pytest
import torch
from torch import nn

from fsdp_course.meta_init import init_weights, materialize, pieces
from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig


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
