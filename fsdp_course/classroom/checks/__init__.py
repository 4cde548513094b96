"""Exercise checkers: run a learner's function on simulated ranks and compare it with a pure computation.

One module per exercise (named after the lesson it follows), the shared machinery in `_common` and
the equivalence harness (`fsdp_course.engines.equivalence`: seeded models and batches, each rank's
slice, one process's steps): a checker either prints what passed (which world sizes, which cases)
or prints exactly what failed (world size, rank, step, tensor, difference) with a hint, and raises
`AssertionError` so that nbgrader scores the cell 0; a function still at its stub gives one `NotImplementedError`.

    01 collectives   check_all_reduce, check_ring_all_reduce
    02 ddp           check_broadcast_parameters, check_ddp
    03 memory        check_zero_memory
    04 zero          check_zero2_reduce (ZeRO-2's bucketed reduce-scatter)
    05 flat_param    check_flat_param
    06 fsdp          check_fsdp_unit
    07 wrapping      check_unit_numels, check_predicted_peak (a wrap policy's units and its predicted peak)
    08 transformer   check_sharded_checkpoint (sharded checkpoint, loaded back under torchrun)
    09 model pitfalls         check_forward_logits, check_make_samples (ids into the embedding, logits per sample)
    10 distributed pitfalls   check_clip_grad_norm, check_train_step
    11 real fsdp     check_fully_shard_units (fully_shard on the course's units, under torchrun)
    13 loss scaling           check_found_inf, check_update_scale (fp16 loss scaling over shards)
    14 overlap                check_forward_prefetch (forward prefetching with async all-gathers)
    16 hsdp                   check_hsdp_grad (HSDP's reduce-scatter in the row, all-reduce across the column)
    17 finetune               check_lora_linear (a LoRA layer, then fine-tuned under FSDP), check_kept_bytes (what a
                              rank keeps with a frozen base, against the bytes measured)
    18 offload                check_device_peak, check_smallest_world_size, check_bytes_sent, check_comm_seconds
    19 checkpoints            check_dim0_chunks (a unit's flat parameter cut into Shard(0) rows, DCP's layout)
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
