"""The engines beside FSDP (floor 3): DDP and ZeRO-1/2, the steps of the course's ladder, and the bridge to
PyTorch's own `fully_shard` (torch_fsdp.py, imported on its own: it loads torch.distributed.fsdp)."""

from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.zero import ZeRO1, ZeRO2

__all__ = ["DDP", "ZeRO1", "ZeRO2"]
