"""Exercise checkers: run a learner's function on simulated ranks and compare it with a pure computation.

Design notes: docs/CLASSROOM.md, "Checkers", `__init__.py`.
"""

from fsdp_course.classroom.checks._common import (
    CheckFailed,
    CheckFailure,
    call_learner,
    compare_tensor,
    format_tensor,
    run_checked,
)
from fsdp_course.classroom.checks.budget import (
    check_bytes_sent,
    check_comm_seconds,
    check_device_peak,
    check_smallest_world_size,
)
from fsdp_course.classroom.checks.checkpoint import check_sharded_checkpoint
from fsdp_course.classroom.checks.collectives import check_all_reduce, check_ring_all_reduce
from fsdp_course.classroom.checks.dcp import check_dim0_chunks
from fsdp_course.classroom.checks.ddp import check_broadcast_parameters, check_ddp
from fsdp_course.classroom.checks.flat_param import check_flat_param
from fsdp_course.classroom.checks.fsdp_unit import check_fsdp_unit
from fsdp_course.classroom.checks.hsdp import check_hsdp_grad
from fsdp_course.classroom.checks.lora import check_kept_bytes, check_lora_linear
from fsdp_course.classroom.checks.memory import check_zero_memory
from fsdp_course.classroom.checks.mixed_precision import check_found_inf, check_update_scale
from fsdp_course.classroom.checks.model_pitfalls import check_forward_logits, check_make_samples
from fsdp_course.classroom.checks.overlap import check_forward_prefetch
from fsdp_course.classroom.checks.pitfalls import check_clip_grad_norm, check_train_step
from fsdp_course.classroom.checks.real_fsdp import check_fully_shard_units
from fsdp_course.classroom.checks.wrapping import check_predicted_peak, check_unit_numels
from fsdp_course.classroom.checks.zero import check_zero2_reduce

__all__ = [
    "CheckFailed",
    "CheckFailure",
    "call_learner",
    "check_all_reduce",
    "check_broadcast_parameters",
    "check_bytes_sent",
    "check_clip_grad_norm",
    "check_comm_seconds",
    "check_ddp",
    "check_device_peak",
    "check_dim0_chunks",
    "check_flat_param",
    "check_forward_logits",
    "check_forward_prefetch",
    "check_found_inf",
    "check_fsdp_unit",
    "check_fully_shard_units",
    "check_hsdp_grad",
    "check_kept_bytes",
    "check_lora_linear",
    "check_make_samples",
    "check_predicted_peak",
    "check_ring_all_reduce",
    "check_sharded_checkpoint",
    "check_smallest_world_size",
    "check_train_step",
    "check_unit_numels",
    "check_update_scale",
    "check_zero2_reduce",
    "check_zero_memory",
    "compare_tensor",
    "format_tensor",
    "run_checked",
]

# every checker remembers the learner's functions it passed with, so a demo cell can wait for a passing answer
from fsdp_course.classroom.progress import recording  # noqa: E402

for _name in [n for n in __all__ if n.startswith("check_")]:
    globals()[_name] = recording(globals()[_name])
