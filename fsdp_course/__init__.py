"""fsdp-course: the support library of a course that teaches Fully Sharded Data Parallel by building it.

Ranks run as threads inside one notebook (`run_ranks`), each with a real Gloo process group; the
same code runs unchanged in real processes under `torchrun` (`RankContext.from_env`). The engines
(`DDP`, `ZeRO1`, `ZeRO2`, `FSDP`) are the references the lessons build and the exercises are checked
against. See README.md, and arXiv:2304.11277 (PyTorch FSDP) and arXiv:1910.02054 (ZeRO).
Figures live in `fsdp_course.viz`; ipywidgets controls in `fsdp_course.viz.widgets` (kept apart so the
core imports without Jupyter).
"""

from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.zero import ZeRO1, ZeRO2
from fsdp_course.fsdp.api import FSDP, ShardedState, TrainingState
from fsdp_course.fsdp.flat_param import FlatParamLayout, OffloadPolicy, shard_parameters
from fsdp_course.fsdp.grad_scaler import ShardedGradScaler
from fsdp_course.fsdp.policy import MixedPrecision
from fsdp_course.lora import LoRALinear, add_lora, merge_lora, remove_lora
from fsdp_course.memory import DeviceOutOfMemory, measure, zero_formula
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Ledger, Record
from fsdp_course.runtime.mesh import Mesh
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch, PeerFailed
from fsdp_course.runtime.simulate import RankError, run_ranks

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

from fsdp_course import i18n as _i18n  # noqa: E402 (after the names it must not shadow)

_i18n.activate()  # in a Chinese notebook's folder or with FSDP_COURSE_LANG=zh: figures in Chinese
