"""Tests for fsdp_course.models: the article's parameter count, shapes, options, determinism."""

from __future__ import annotations

import warnings

import pytest
import torch

from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig, count_parameters


def _build(config: TransformerConfig, seed: int = 0) -> TransformerClassifier:
    torch.manual_seed(seed)
    return TransformerClassifier(config)


def _tokens(config: TransformerConfig, batch: int = 5, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, config.max_len), generator=g)


def test_article_size_has_the_articles_parameter_count():
    # The article's log: "Sharded param created with grad tracking, size: 29164304" (world size 1).
    # Built on the CPU (117 MB, ~0.3 s): on the meta device, nn.init.normal_ imports torch._dynamo
    # the first time, which costs seconds.
    model = TransformerClassifier(TransformerConfig.article())
    assert count_parameters(model) == 29_164_304
    assert sum(p.numel() for p in model.parameters()) == 29_164_304
    # the pieces: embedding 10000x512, six post-norm layers, no final norm, 512 -> 10000 head
    assert model.encoder.norm is None
    assert model.pos_embedding is None
    assert model.fc.out_features == 10000
    assert len(model.encoder.layers) == 6
    assert model.encoder.layers[0].linear1.out_features == 4 * 512


def test_article_options_add_exactly_their_parameters():
    both = TransformerClassifier(TransformerConfig.article(positional=True, pre_norm=True))
    # + learned positions (784 x 512) + final LayerNorm (2 x 512)
    assert count_parameters(both) == 29_164_304 + 784 * 512 + 2 * 512


@pytest.mark.parametrize("factory", [TransformerConfig.small, TransformerConfig.tiny])
@pytest.mark.parametrize("options", [{}, {"positional": False, "pre_norm": False}])
def test_output_shape_and_no_warnings(factory, options):
    config = factory(**options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _build(config)
        logits = model(_tokens(config, batch=3))
    assert logits.shape == (3, config.num_classes)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_shorter_sequences_are_accepted():
    config = TransformerConfig.tiny()
    model = _build(config)
    assert model(_tokens(config)[:, :10]).shape == (5, 10)


def test_bad_inputs_raise():
    config = TransformerConfig.tiny()
    model = _build(config)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(config.max_len, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, config.max_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig.small(d_model=30)


def test_deterministic_with_dropout_zero_in_train_eval_and_no_grad():
    config = TransformerConfig.small()
    a, b = _build(config, seed=3), _build(config, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    x = _tokens(config)
    out_train = a(x)
    assert torch.equal(out_train, b(x))
    assert torch.equal(out_train, a(x))
    a.eval()
    with torch.no_grad():
        # batch_first=False keeps PyTorch's eval "fast path" off: same kernels, same bits
        assert torch.equal(a(x), out_train)


def test_positional_makes_the_model_order_aware():
    x = _tokens(TransformerConfig.small())
    perm = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(0))
    bag = _build(TransformerConfig.small(positional=False)).eval()
    with torch.no_grad():
        # without positions, attention + mean ignore token order (up to rounding)
        assert (bag(x[:, perm]) - bag(x)).abs().max() < 1e-4
    ordered = _build(TransformerConfig.small(positional=True)).eval()
    with torch.no_grad():
        assert (ordered(x[:, perm]) - ordered(x)).abs().max() > 1e-3


def test_pre_norm_option_changes_the_layers():
    post = _build(TransformerConfig.small(pre_norm=False))
    pre = _build(TransformerConfig.small(pre_norm=True))
    assert all(not layer.norm_first for layer in post.encoder.layers)
    assert all(layer.norm_first for layer in pre.encoder.layers)
    assert post.encoder.norm is None and isinstance(pre.encoder.norm, torch.nn.LayerNorm)
    # same seed, same shared parameters, different function
    x = _tokens(TransformerConfig.small())
    with torch.no_grad():
        pre.encoder.norm = None  # only norm placement differs now
        pre.load_state_dict(post.state_dict())
        assert (pre(x) - post(x)).abs().max() > 1e-3


def test_layers_are_separate_modules():
    model = _build(TransformerConfig.tiny())
    l0, l1 = model.encoder.layers
    assert l0 is not l1
    assert l0.linear1.weight.data_ptr() != l1.linear1.weight.data_ptr()


def test_mlp_shapes_and_structure():
    torch.manual_seed(0)
    mlp = MLP([64, 32, 16, 10])
    assert [layer.in_features for layer in mlp.layers] == [64, 32, 16]
    assert count_parameters(mlp) == 64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10
    out = mlp(torch.rand(7, 64))
    assert out.shape == (7, 10)
    assert (out < 0).any()  # no ReLU after the last layer
    with pytest.raises(ValueError):
        MLP([64])


def test_count_parameters_trainable_only_and_shared():
    mlp = MLP([4, 3, 2])
    mlp.layers[0].weight.requires_grad_(False)
    assert count_parameters(mlp) == 4 * 3 + 3 + 3 * 2 + 2
    assert count_parameters(mlp, trainable_only=True) == 3 + 3 * 2 + 2
    tied = torch.nn.Sequential(mlp.layers[1], mlp.layers[1])
    assert count_parameters(tied) == 3 * 2 + 2
