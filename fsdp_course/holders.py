"""Which engine holds a module: DDP, ZeRO and FSDP claim the module they wrap, and a second claim is refused.

Rank threads share one interpreter, so a model built once in a cell and wrapped inside the rank function without
`copy.deepcopy` is one set of tensors for every rank: each rank's engine would write the others' parameters.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

__all__ = ["HeldError", "claim", "holder", "holds", "release"]


class HeldError(ValueError):
    """A module another engine already holds: the message says whose, and what to do instead."""


@dataclass
class _Claim:
    engine: weakref.ref  # the wrapper (DDP, ZeRO1, ZeRO2, FSDP)
    kind: str  # its class name
    rank: int
    run: weakref.ref | None  # the run's monitor (rank threads) or process group (torchrun): the ranks of one run
    consumes: bool  # FSDP moves the parameters out of the module: it can never be wrapped again


_HELD: weakref.WeakKeyDictionary[nn.Module, _Claim] = weakref.WeakKeyDictionary()
_ENGINES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_LOCK = threading.Lock()


def _run(ctx: Any) -> Any:
    """What the ranks of one run share: the world's monitor (rank threads), else its process group."""
    while getattr(ctx, "parent", None) is not None:  # a mesh's subgroup context: its world's
        ctx = ctx.parent
    return getattr(ctx, "_monitor", None) or getattr(ctx, "group", None)


def _why(claim: _Claim, module: nn.Module, name: str, rank: int, run: Any, kind: str) -> str | None:
    """Why `kind` on `rank` of `run` may not wrap `module` (at `name` inside the module given), or None."""
    where = f"its submodule {name!r}" if name else "this module"
    live = claim.engine() is not None and (claim.run is None or claim.run() is run)  # an engine of this run
    if live and claim.rank != rank:
        return (f"rank {claim.rank}'s {claim.kind} already holds {where}: the ranks share one module object, so each "
                f"would overwrite the others' parameters. Give each rank its own copy: {kind}(copy.deepcopy(model), "
                "ctx, ...) inside the rank function (or build the model there)")
    if claim.consumes:
        return (f"{where} was wrapped by an FSDP already: its parameters now live in that FSDP's flat shards, so a "
                f"second {kind} would find none. Wrap a fresh copy of the model (copy.deepcopy(base)), or use the "
                "FSDP you have")
    if not live:
        return None  # the engine is gone, or it belongs to a run that is over
    return (f"{where} is already wrapped by a {claim.kind} on this rank: wrap a model once, and pass the "
            f"{claim.kind} itself where the wrapped model is needed")


def claim(engine: nn.Module, module: nn.Module, ctx: Any, *, consumes: bool = False) -> None:
    """Record that `engine` (on `ctx`'s rank) holds `module`; raise `HeldError` if it or a submodule is an engine,
    or is held by another live engine of the same run, or was consumed by an FSDP. Call it before changing anything.
    """
    kind, rank, run = type(engine).__name__, getattr(ctx, "rank", 0), _run(ctx)
    with _LOCK:
        if (held := _HELD.get(module)) is not None and held.engine() is engine:
            return  # a subclass's constructor and its parent's: one claim
        for name, sub in module.named_modules():
            if sub in _ENGINES:
                raise HeldError(f"{kind} around {type(sub).__name__}{f' (at {name!r})' if name else ''}: a model is "
                                f"wrapped once. Pass the unwrapped model to {kind}, or use the "
                                f"{type(sub).__name__} as it is")
            held = _HELD.get(sub)
            why = _why(held, sub, name, rank, run, kind) if held is not None else None
            if why:
                raise HeldError(why)
        _HELD[module] = _Claim(weakref.ref(engine), kind, rank, weakref.ref(run) if run is not None else None,
                               consumes)
        _ENGINES.add(engine)


def release(engine: nn.Module, module: nn.Module) -> None:
    """Undo `claim` (a constructor that raised after claiming): the module is free again."""
    with _LOCK:
        held = _HELD.get(module)
        if held is not None and held.engine() is engine:
            del _HELD[module]
        _ENGINES.discard(engine)


def holder(module: nn.Module) -> str | None:
    """A sentence naming the engine that holds `module` or one of its submodules (the course's, or torch's
    `fully_shard`), or None if none does."""
    for name, sub in module.named_modules():
        where = f"{name!r}" if name else "the model"
        if sub in _ENGINES:
            return f"{where} is a wrapper ({type(sub).__name__})"
        held = _HELD.get(sub)
        if held is not None and (held.consumes or held.engine() is not None):
            return f"{where} is wrapped by {held.kind}"
        if any(c.__name__ == "FSDPModule" for c in type(sub).__mro__):
            return f"{where} is sharded by torch's fully_shard"
    return None


Init = TypeVar("Init", bound=Callable[..., None])


def holds(*, consumes: bool = False) -> Callable[[Init], Init]:
    """Decorate an engine's `__init__(self, module, ctx, ...)`: claim `module` first, release it if it raises."""
    def decorate(init: Init) -> Init:
        signature = inspect.signature(init)

        @functools.wraps(init)
        def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind_partial(self, *args, **kwargs).arguments
            module, ctx = bound.get("module"), bound.get("ctx")
            if not isinstance(module, nn.Module):
                return init(self, *args, **kwargs)  # its own checks say what is wrong
            claim(self, module, ctx, consumes=consumes)
            try:
                init(self, *args, **kwargs)
            except BaseException:
                release(self, module)
                raise
        return wrapper  # type: ignore[return-value]
    return decorate
