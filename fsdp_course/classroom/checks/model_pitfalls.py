"""Checkers of exercise 09: the classifier's forward path by hand, and training data with one input per sample.

The article's pitfalls 5.1 and 5.2 and its identical-samples bug (lesson 09), as code a learner writes:

- `forward_logits(model, tokens) -> logits`: a `TransformerClassifier` (no positions, `batch_first=False`) run
  layer by layer, from `(B, T)` integer token ids to `(B, classes)` float logits: embed the ids (integers into the
  `Embedding`, floats after it), scale, go to the encoder's `(T, B, d)`, pool over the sequence (dim 0), apply the
  head. Compared with `model(tokens)` on inputs where T != B, so that confusing the two dimensions shows; a result
  that differs is matched against the usual wrong paths (pooled over the batch, no transpose, no scale, a sum)
  and named.
- `make_samples(n, seq, vocab, generator) -> (inputs, labels)`: the article's data loop fixed: each of the n
  samples its own random ids in [0, vocab), drawn from `generator`, and its label `sum(ids) % 10` computed from
  its own ids (the article's loop built `torch.arange(784)` for every i: one input, one label, n times).

`F.cross_entropy` wants `(batch, classes)` logits and `(batch,)` targets (PyTorch's documentation of
`torch.nn.functional.cross_entropy`); `nn.Embedding` takes integer indices (that of `torch.nn.Embedding`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    exception_hint,
    format_tensor,
    require_callable,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.models import TransformerClassifier, TransformerConfig

__all__ = ["check_forward_logits", "check_make_samples", "checker_model", "wrong_paths"]

CASES = ((3, 5), (2, 7), (1, 6))  # (batch, seq): seq != batch, so a pooled or swapped dimension shows
SEED = 9

T = catalogue("model_pitfalls", {
    "pooled_batch": ("pooled over the batch dimension (dim 1 of (seq, batch, d)): logits (seq, classes)",
                     "在批次维上做了池化（(seq, batch, d) 的 dim 1）：logits 的形状成了 (seq, classes)"),
    "mean_over_seq": ("the encoder's output is (seq, batch, d) (batch_first=False): take the mean over the sequence, "
                      "dim 0, to get one vector per sample",
                      "编码器的输出是 (seq, batch, d)（batch_first=False）：在序列维 dim 0 上取平均，"
                      "每个样本得到一个向量"),
    "not_pooled_seq": ("not pooled: logits (seq, batch, classes), one row per token",
                       "没有池化：logits 的形状是 (seq, batch, classes)，每个 token 一行"),
    "not_pooled_batch": ("not pooled: logits (batch, seq, classes), one row per token",
                         "没有池化：logits 的形状是 (batch, seq, classes)，每个 token 一行"),
    "row_per_sample": ("cross_entropy wants one row of logits per sample: take the mean over the sequence (dim 0 of "
                       "the encoder's (seq, batch, d)) before the head",
                       "cross_entropy 要求每个样本一行 logits：在分类头之前对序列取平均（编码器输出 (seq, batch, d) 的 "
                       "dim 0）"),
    "no_transpose": ("no transpose: the encoder read (batch, seq, d) as (seq, batch, d), so attention mixed the "
                     "samples",
                     "没有转置：编码器把 (batch, seq, d) 当成了 (seq, batch, d)，所以注意力把不同样本混在了一起"),
    "no_transpose_pooled": ("no transpose: the encoder read (batch, seq, d) as (seq, batch, d), and the mean over "
                            "dim 0 then pooled the batch: logits (seq, classes)",
                            "没有转置：编码器把 (batch, seq, d) 当成了 (seq, batch, d)，于是 dim 0 上的平均"
                            "池化的是批次：logits 的形状成了 (seq, classes)"),
    "transpose_first": ("the encoder has batch_first=False: transpose the embeddings to (seq, batch, d) before it "
                        "(x.transpose(0, 1)), then pool over dim 0",
                        "编码器的 batch_first=False：在它之前把嵌入转置成 (seq, batch, d)（x.transpose(0, 1)），"
                        "再在 dim 0 上池化"),
    "not_scaled": ("the embeddings were not multiplied by model.scale", "嵌入没有乘以 model.scale"),
    "scale_embeddings": ("the article scales the embeddings by sqrt(d_model) before the encoder: x = "
                         "model.embedding(tokens) * model.scale",
                         "文章在编码器之前把嵌入乘以 sqrt(d_model)：x = model.embedding(tokens) * model.scale"),
    "summed": ("a sum over the sequence, not its mean", "对序列求了和，而不是取平均"),
    "pool_mean": ("pool with .mean(dim=0), as the article's x.mean(0): a sum grows with the sequence length",
                  "用 .mean(dim=0) 池化，与文章的 x.mean(0) 一样：求和会随序列长度增长"),
    "ids_float": ("token ids cast to float before the embedding: an Embedding looks rows up, so give it the integer "
                  "ids as they are (no .float() on tokens)",
                  "token id 在进入嵌入层之前被转成了 float：Embedding 是按行查表的，直接给它整数 id"
                  "（不要对 tokens 调用 .float()）"),
    "long_reached": ("a long (integer) tensor reached a Linear or the encoder: only the embedding takes the ids; what "
                     "comes out of it is float, keep it float (no .long())",
                     "一个 long（整数）张量进入了 Linear 或编码器：只有嵌入层接受 id；它的输出是 float，保持 float"
                     "（不要 .long()）"),
    "follow_shapes": ("follow the shapes: (B, T) ids -> (B, T, d) embeddings -> (T, B, d) for the encoder",
                      "跟着形状走：(B, T) 的 id -> (B, T, d) 的嵌入 -> 给编码器的 (T, B, d)"),
    "called_model": ("{name} called model(tokens)", "{name} 调用了 model(tokens)"),
    "use_layers": ("write the path with the model's layers (model.embedding, model.encoder, model.fc): model(tokens) "
                   "is what the checker compares with",
                   "用模型的各层写出这条路径（model.embedding、model.encoder、model.fc）："
                   "检查器拿 model(tokens) 来比较"),
    "turned_into": ("turned them into {dtype}", "把它们转成了 {dtype}"),
    "changed_values": ("changed their values", "改变了它们的值"),
    "changed_tokens": ("{name} changed the tokens it was given: {changed}", "{name} 改动了传给它的 tokens：{changed}"),
    "leave_ids": ("leave the ids as they are: an Embedding takes integer ids; cast nothing in place",
                  "保持 id 不变：Embedding 接受整数 id；不要原地做任何类型转换"),
    "not_logits": ("returned {kind}, not the logits", "返回了 {kind}，而不是 logits"),
    "return_head": ("return the head's output, model.fc(pooled)", "返回分类头的输出 model.fc(pooled)"),
    "logits_dtype": ("logits are {got}, expected {expected}", "logits 是 {got}，应为 {expected}"),
    "float_logits": ("the logits are the float output of model.fc: cast nothing to long",
                     "logits 是 model.fc 输出的 float：不要把任何东西转成 long"),
    "logits_shape": ("logits of shape {got}, expected (batch, classes) = {expected}",
                     "logits 的形状是 {got}，应为 (batch, classes) = {expected}"),
    "class_scores": ("F.cross_entropy wants one row of class scores per sample: (seq, batch, d) from the encoder, the "
                     "mean over dim 0, then model.fc",
                     "F.cross_entropy 要求每个样本一行类别分数：编码器输出 (seq, batch, d)，在 dim 0 上取平均，"
                     "再接 model.fc"),
    "counts_tokens": ("the first dimension counts tokens, not samples: pool over the sequence (dim 0 of (seq, batch, "
                      "d))", "第一维对应的是 token，而不是样本：在序列上池化（(seq, batch, d) 的 dim 0）"),
    "logits_differ": ("the logits differ from the model's forward", "logits 与模型自身前向的结果不同"),
    "each_step": ("embedding * model.scale, transpose to (seq, batch, d), model.encoder, .mean(dim=0), model.fc: "
                  "compare each step's shape",
                  "embedding * model.scale，转置成 (seq, batch, d)，model.encoder，.mean(dim=0)，model.fc："
                  "逐一比较每一步的形状"),
    "not_pair": ("returned {kind}, not a pair of tensors", "返回了 {kind}，而不是一对张量"),
    "return_pair": ("return inputs, labels", "返回 inputs, labels"),
    "inputs_shape": ("inputs of shape {got}, expected (n, seq) = {expected}",
                     "inputs 的形状是 {got}，应为 (n, seq) = {expected}"),
    "row_of_ids": ("one row of seq token ids per sample: torch.randint(0, vocab, (n, seq), generator=...)",
                   "每个样本一行，共 seq 个 token id：torch.randint(0, vocab, (n, seq), generator=...)"),
    "inputs_dtype": ("inputs are {dtype}: token ids must be integers (torch.long)",
                     "inputs 是 {dtype}：token id 必须是整数（torch.long）"),
    "draw_integers": ("an Embedding takes integer ids: draw them with torch.randint, and cast nothing to float",
                      "Embedding 接受整数 id：用 torch.randint 生成，不要转成 float"),
    "ids_range": ("ids from {low} to {high}, outside [0, {vocab})", "id 从 {low} 到 {high}，超出了 [0, {vocab})"),
    "embedding_rows": ("an Embedding(vocab, d) has rows 0 .. vocab - 1: torch.randint(0, vocab, ...)",
                       "Embedding(vocab, d) 的行号是 0 .. vocab - 1：torch.randint(0, vocab, ...)"),
    "same_input": ("every sample has the same input ({n} copies of one row)",
                   "每个样本的输入都相同（同一行的 {n} 份拷贝）"),
    "x_without_i": ("the article's bug: x did not depend on i; draw each sample's ids anew, e.g. all at once with "
                    "torch.randint(0, vocab, (n, seq), generator=generator)",
                    "文章的 bug：x 不依赖于 i；为每个样本重新生成 id，例如用 torch.randint(0, vocab, (n, seq), "
                    "generator=generator) 一次性全部生成"),
    "labels_shape": ("labels of shape {got}, expected (n,) = {expected}",
                     "labels 的形状是 {got}，应为 (n,) = {expected}"),
    "one_class": ("one class index per sample, a 1-D tensor: F.cross_entropy wants targets of shape (batch,)",
                  "每个样本一个类别下标，是一维张量：F.cross_entropy 要求 targets 的形状为 (batch,)"),
    "labels_dtype": ("labels are {dtype}, expected torch.long class indices",
                     "labels 是 {dtype}，应为 torch.long 的类别下标"),
    "long_labels": ("F.cross_entropy takes class indices as integers: inputs.sum(1) % 10 stays long",
                    "F.cross_entropy 要求类别下标是整数：inputs.sum(1) % 10 本身就是 long"),
    "wrong_label": ("label {i} is {got}, expected sum(inputs[{i}]) % 10 = {expected}",
                    "标签 {i} 是 {got}，应为 sum(inputs[{i}]) % 10 = {expected}"),
    "same_label": ("every sample has the same label ({label}), not its own sum % 10",
                   "每个样本的标签都相同（{label}），而不是它自己的 sum % 10"),
    "own_ids": ("label each sample by its own ids: inputs.sum(dim=1) % 10",
                "用每个样本自己的 id 打标签：inputs.sum(dim=1) % 10"),
    "seeds": ("the same generator seed gave other data, or another seed the same data",
              "同一个 generator 种子给出了不同的数据，或者另一个种子给出了相同的数据"),
    "from_generator": ("draw the ids from the generator you are given: torch.randint(..., generator=generator)",
                       "用给你的 generator 生成 id：torch.randint(..., generator=generator)"),
    # what passed
    "logits_cases": ("batch, seq = {cases}", "批大小和序列长度为 {cases}"),
    "logits_passed": ("  long ids into the embedding, float from there on, (seq, batch, d) into the encoder, the mean "
                      "over the sequence: (batch, classes) logits equal to the model's own forward, ready for "
                      "F.cross_entropy",
                      "  long 类型的 id 送入嵌入层，此后都是 float，(seq, batch, d) 送入编码器，再对序列求平均："
                      "得到的 (batch, classes) logits 与模型自己的前向结果相同，可以直接交给 F.cross_entropy"),
    "samples_cases": ("n={n}, seq={seq}, vocab={vocab}; seeds 1 and 2", "n={n}, seq={seq}, vocab={vocab}；种子 1 和 2"),
    "samples_passed": ("  {distinct} distinct inputs of {n}, {labels} distinct labels, each sum % 10 of its own ids; "
                       "F.cross_entropy takes them with the model's (n, classes) logits",
                       "  {n} 个输入中有 {distinct} 个互不相同，共 {labels} 种标签，"
                       "每个标签都是它自己那些 id 之和 % 10；F.cross_entropy 可以把它们和模型的 (n, classes) logits "
                       "一起使用"),
})


def checker_model() -> TransformerClassifier:
    """The checker's model: the article's kind of layer, small (vocab 17, d 16, 2 heads, 1 layer, 10 classes)."""
    torch.manual_seed(SEED)
    config = TransformerConfig.small(d_model=16, nhead=2, num_layers=1, positional=False, pre_norm=False)
    return TransformerClassifier(config).eval()


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 100 * batch + seq)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def wrong_paths(model: TransformerClassifier, tokens: torch.Tensor) -> list[tuple[torch.Tensor, Message, Message]]:
    """The usual wrong forward paths on `tokens`, each as (logits it gives, problem, hint)."""
    e = model.embedding(tokens)  # (B, T, d)
    seq_first = (e * model.scale).transpose(0, 1)  # (T, B, d)
    encoded = model.encoder(seq_first)
    unswapped = model.encoder(e * model.scale)  # (B, T, d) read as (seq, batch, d)
    return [
        (model.fc(encoded.mean(1)), T("pooled_batch"), T("mean_over_seq")),
        (model.fc(encoded), T("not_pooled_seq"), T("row_per_sample")),
        (model.fc(encoded).transpose(0, 1), T("not_pooled_batch"), T("row_per_sample")),
        (model.fc(unswapped.mean(1)), T("no_transpose"), T("transpose_first")),
        (model.fc(unswapped.mean(0)), T("no_transpose_pooled"), T("transpose_first")),
        (model.fc(model.encoder(e.transpose(0, 1)).mean(0)), T("not_scaled"), T("scale_embeddings")),
        (model.fc(encoded.sum(0)), T("summed"), T("pool_mean")),
    ]


def _forward_hint(exc: BaseException) -> Message:
    text = str(exc)
    if "'indices'" in text and "Long, Int" in text:
        return T("ids_float")
    if "mat1 and mat2 must have the same dtype" in text or "same dtype" in text:
        return T("long_reached")
    if "shape" in text and ("batch_size" in text or "TransformerEncoder" in text or "embed_dim" in text):
        return T("follow_shapes")
    return exception_hint(exc)


def check_forward_logits(fn: Callable[[TransformerClassifier, torch.Tensor], Any]) -> None:
    """Check `fn(model, tokens) -> logits`: `(B, T)` long ids to `(B, classes)` float logits, layer by layer.

    Compared with `model(tokens)` (the course's forward) for (batch, seq) in `CASES`; the tokens must come back
    unchanged (still integers) and `model(...)` itself must not be called.
    """
    check = "check_forward_logits"
    name = require_callable(check, fn, "forward_logits")
    model = checker_model()
    called_model = []
    handle = model.register_forward_pre_hook(lambda module, args: called_model.append(True))
    try:
        for batch, seq in CASES:
            tokens = _tokens(batch, seq, model.config.vocab_size)
            where = f"tokens of shape (batch {batch}, seq {seq}), {model.config.num_classes} classes"
            with torch.no_grad():
                expected = model(tokens)
            called_model.clear()
            given = tokens.clone()
            with torch.no_grad():
                got = call_learner(check, name, fn, model, given, where=where, hint_for=_forward_hint)
            if called_model:
                CheckFailure(check, where, T("called_model", name=name), T("use_layers")).fail()
            if given.dtype != tokens.dtype or not torch.equal(given, tokens):
                changed = (T("turned_into", dtype=given.dtype) if given.dtype != tokens.dtype
                           else T("changed_values"))
                CheckFailure(check, where, T("changed_tokens", name=name, changed=changed), T("leave_ids")).fail()
            _compare_logits(check, where, model, tokens, expected, got)
    finally:
        handle.remove()
    say(COMMON("passed", check=check, what=T("logits_cases", cases=", ".join(f"({b}, {t})" for b, t in CASES))),
        T("logits_passed"))


def _compare_logits(check: str, where: str, model: TransformerClassifier, tokens: torch.Tensor,
                    expected: torch.Tensor, got: Any) -> None:
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, T("not_logits", kind=type(got).__name__), T("return_head")).fail()
    got = got.detach()
    batch, seq = tokens.shape
    details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}"]
    if got.dtype != expected.dtype:
        CheckFailure(check, where, T("logits_dtype", got=got.dtype, expected=expected.dtype), T("float_logits"),
                     details).fail()
    if tuple(got.shape) == tuple(expected.shape) and torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return
    with torch.no_grad():
        for logits, problem, hint in wrong_paths(model, tokens):
            if logits.shape == got.shape and torch.allclose(got, logits, rtol=1e-4, atol=1e-5):
                CheckFailure(check, where, problem, hint, details).fail()
    if tuple(got.shape) != tuple(expected.shape):
        problem = T("logits_shape", got=tuple(got.shape), expected=tuple(expected.shape))
        hint = T("class_scores")
        if seq in got.shape[:1] and batch not in got.shape:
            hint = T("counts_tokens")
        CheckFailure(check, where, problem, hint, details).fail()
    CheckFailure(check, where, T("logits_differ"), T("each_step"), details).fail()


def check_make_samples(fn: Callable[[int, int, int, torch.Generator], Any]) -> None:
    """Check `fn(n, seq, vocab, generator) -> (inputs, labels)`: n different random samples, each labelled by its ids.

    inputs: `(n, seq)` long ids in [0, vocab), drawn from `generator` (the same seed gives the same data, another
    seed other data); labels: `(n,)` long, `inputs.sum(1) % 10`. Then one step of `F.cross_entropy` on a model's
    logits for them must run.
    """
    check = "check_make_samples"
    name = require_callable(check, fn, "make_samples")
    n, seq, vocab = 32, 6, 17
    where = f"n={n}, seq={seq}, vocab={vocab}"
    out = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        CheckFailure(check, where, T("not_pair", kind=type(out).__name__), T("return_pair")).fail()
    inputs, labels = out
    if tuple(inputs.shape) != (n, seq):
        CheckFailure(check, where, T("inputs_shape", got=tuple(inputs.shape), expected=(n, seq)), T("row_of_ids")
                     ).fail()
    if inputs.dtype != torch.long:
        CheckFailure(check, where, T("inputs_dtype", dtype=inputs.dtype), T("draw_integers")).fail()
    if int(inputs.min()) < 0 or int(inputs.max()) >= vocab:
        CheckFailure(check, where, T("ids_range", low=int(inputs.min()), high=int(inputs.max()), vocab=vocab),
                     T("embedding_rows")).fail()
    if len(inputs.unique(dim=0)) == 1:
        CheckFailure(check, where, T("same_input", n=n), T("x_without_i"),
                     [f"inputs[0] {format_tensor(inputs[0])}"]).fail()
    expected = inputs.sum(1) % 10
    if tuple(labels.shape) != (n,):
        CheckFailure(check, where, T("labels_shape", got=tuple(labels.shape), expected=(n,)), T("one_class")).fail()
    if labels.dtype != torch.long:
        CheckFailure(check, where, T("labels_dtype", dtype=labels.dtype), T("long_labels")).fail()
    if not torch.equal(labels, expected):
        bad = int((labels != expected).nonzero()[0])
        problem = T("wrong_label", i=bad, got=int(labels[bad]), expected=int(expected[bad]))
        if (labels == labels[0]).all():
            problem = T("same_label", label=int(labels[0]))
        CheckFailure(check, where, problem, T("own_ids"),
                     [f"expected {format_tensor(expected)}", f"got      {format_tensor(labels)}"]).fail()
    again = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(1), where=where)
    other = call_learner(check, name, fn, n, seq, vocab, torch.Generator().manual_seed(2), where=where)
    if not torch.equal(again[0], inputs) or torch.equal(other[0], inputs):
        CheckFailure(check, where, T("seeds"), T("from_generator")).fail()
    model = checker_model()
    loss = F.cross_entropy(model(inputs), labels)  # the pitfall 5.2 pairing: (n, classes) logits, (n,) targets
    assert torch.isfinite(loss)
    say(COMMON("passed", check=check, what=T("samples_cases", n=n, seq=seq, vocab=vocab)),
        T("samples_passed", distinct=len(inputs.unique(dim=0)), n=n, labels=len(labels.unique())))
