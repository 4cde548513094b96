"""fsdp-course: the support library of a course that teaches Fully Sharded Data Parallel by building it.

Ranks run as threads inside one notebook (`run_ranks`), each with a real Gloo process group; the
same code runs unchanged in real processes under `torchrun` (`RankContext.from_env`). The engines
(`DDP`, `ZeRO1`, `ZeRO2`, `FSDP`) are the references the lessons build and the exercises are checked
against. See README.md, and arXiv:2304.11277 (PyTorch FSDP) and arXiv:1910.02054 (ZeRO).
Figures live in `fsdp_course.viz`; ipywidgets controls in `fsdp_course.viz.widgets` (kept apart so the
core imports without Jupyter).
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names load on first use
    from fsdp_course.engines.ddp import DDP
    from fsdp_course.engines.zero import ZeRO1, ZeRO2
    from fsdp_course.fsdp.api import FSDP, ShardedState, TrainingState
    from fsdp_course.fsdp.flat_param import FlatParamLayout, shard_parameters
    from fsdp_course.fsdp.grad_scaler import ShardedGradScaler
    from fsdp_course.fsdp.policy import MixedPrecision, OffloadPolicy
    from fsdp_course.lora import LoRALinear, add_lora, merge_lora, remove_lora
    from fsdp_course.memory import DeviceOutOfMemory, measure, zero_formula
    from fsdp_course.runtime.context import RankContext
    from fsdp_course.runtime.ledger import Ledger, Record
    from fsdp_course.runtime.mesh import Mesh
    from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch, PeerFailed
    from fsdp_course.runtime.simulate import RankError, run_ranks

_WHERE = {  # public name -> the module that defines it: imported on first use, so that
    # `import fsdp_course.i18n` or `python -m fsdp_course.classroom.translations` does not load torch
    "DDP": "fsdp_course.engines.ddp",
    "ZeRO1": "fsdp_course.engines.zero",
    "ZeRO2": "fsdp_course.engines.zero",
    "FSDP": "fsdp_course.fsdp.api",
    "ShardedState": "fsdp_course.fsdp.api",
    "TrainingState": "fsdp_course.fsdp.api",
    "FlatParamLayout": "fsdp_course.fsdp.flat_param",
    "OffloadPolicy": "fsdp_course.fsdp.policy",
    "shard_parameters": "fsdp_course.fsdp.flat_param",
    "ShardedGradScaler": "fsdp_course.fsdp.grad_scaler",
    "MixedPrecision": "fsdp_course.fsdp.policy",
    "LoRALinear": "fsdp_course.lora",
    "add_lora": "fsdp_course.lora",
    "merge_lora": "fsdp_course.lora",
    "remove_lora": "fsdp_course.lora",
    "DeviceOutOfMemory": "fsdp_course.memory",
    "measure": "fsdp_course.memory",
    "zero_formula": "fsdp_course.memory",
    "RankContext": "fsdp_course.runtime.context",
    "Ledger": "fsdp_course.runtime.ledger",
    "Record": "fsdp_course.runtime.ledger",
    "Mesh": "fsdp_course.runtime.mesh",
    "CollectiveHang": "fsdp_course.runtime.monitor",
    "CollectiveMismatch": "fsdp_course.runtime.monitor",
    "PeerFailed": "fsdp_course.runtime.monitor",
    "RankError": "fsdp_course.runtime.simulate",
    "run_ranks": "fsdp_course.runtime.simulate",
}

__all__ = [
    "DDP",
    "FSDP",
    "CollectiveHang",
    "CollectiveMismatch",
    "DeviceOutOfMemory",
    "FlatParamLayout",
    "LoRALinear",
    "Ledger",
    "Mesh",
    "MixedPrecision",
    "OffloadPolicy",
    "PeerFailed",
    "RankContext",
    "RankError",
    "Record",
    "ShardedGradScaler",
    "ShardedState",
    "TrainingState",
    "ZeRO1",
    "ZeRO2",
    "add_lora",
    "measure",
    "merge_lora",
    "remove_lora",
    "run_ranks",
    "shard_parameters",
    "zero_formula",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # once
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # `fsdp_course.viz` after a bare `import fsdp_course`
    raise AttributeError(f"module 'fsdp_course' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


from fsdp_course import i18n as _i18n  # noqa: E402 (after the names it must not shadow)

_i18n.activate()  # in a Chinese notebook's folder or with FSDP_COURSE_LANG=zh: figures in Chinese
