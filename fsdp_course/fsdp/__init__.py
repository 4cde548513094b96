"""The course's FSDP, file for file with PyTorch's FSDP2 (torch/distributed/fsdp/_fully_shard/):

  api.py          FSDP: wrapping, the hooks, the final callback  _fully_shard.py (FSDPModule), _fsdp_state.py
  param_group.py  FSDPUnit: one unit's unshard / reshard cycle   _fsdp_param_group.py (FSDPParamGroup)
  flat_param.py   the flat parameter: layout, shard, unsharded   _fsdp_param.py (FSDPParam, per parameter);
                  buffer and its views                           FSDP1's _flat_param.py (FlatParamHandle)
  common.py       TrainingState, ShardedState, placeholders      _fsdp_common.py
  policy.py       MixedPrecision, OffloadPolicy                  _fsdp_api.py (MixedPrecisionPolicy, CPUOffloadPolicy)
  grad_scaler.py  fp16 loss scaling, global found-inf check      torch/distributed/fsdp/sharded_grad_scaler.py
  per_param.py    FSDP2's layout: per-parameter dim-0 shards     _fsdp_param.py, _fsdp_collectives.py
  state_dict.py   full and sharded checkpoints                   FSDP2: DTensor state dicts (DCP reads them)
  dcp.py          DCP checkpoints: Shard(0) DTensors per         torch/distributed/checkpoint/,
                  parameter, resharded at any world size         checkpoint/state_dict.py (get_state_dict)
  meta_init.py    initialization without the whole model         _fsdp_init.py, reset_parameters on meta

Glossary (after FSDP2's "[Note: FSDP tensors]" in _fsdp_param.py, which names the tensors an FSDPParam holds):
  shard             this rank's chunk of a unit's flat parameter, `(padded_numel // N,)`, an nn.Parameter:
                    what the optimizer steps. FSDP2's "sharded parameter": a DTensor whose local tensor is
                    dim-0 chunk r of one parameter (FSDP2 shards every parameter on its own; the course,
                    like FSDP1 and the article, shards one flat parameter per unit).
  padding           zeros that make the flat parameter divide by N (FSDP2 pads each parameter's dim 0).
  unsharded         the gathered `(padded_numel,)` buffer, an autograd leaf; its storage exists only between
                    unshard() and reshard(). FSDP2's "all-gather output", which for plain tensors shares its
                    data with the "unsharded parameter".
  views             the original parameter shapes cut out of `unsharded`: FSDP2's unsharded parameters. The
                    module's attributes point at them while the unit is unsharded, at `ShardedAway`
                    placeholders otherwise.
  sharded / unsharded   `ShardedState`; IDLE / FORWARD / PRE_BACKWARD / POST_BACKWARD: `TrainingState`.
"""

from fsdp_course.fsdp.api import FSDP
from fsdp_course.fsdp.common import ShardedState, TrainingState
from fsdp_course.fsdp.flat_param import FlatParamHandle, FlatParamLayout, flatten_params, padded_numel, shard_parameters
from fsdp_course.fsdp.grad_scaler import ShardedGradScaler
from fsdp_course.fsdp.param_group import CommContext, FSDPUnit, Span
from fsdp_course.fsdp.policy import MixedPrecision

__all__ = ["FSDP", "CommContext", "FSDPUnit", "FlatParamHandle", "FlatParamLayout", "MixedPrecision",
           "ShardedGradScaler", "ShardedState", "Span", "TrainingState", "flatten_params", "padded_numel",
           "shard_parameters"]
