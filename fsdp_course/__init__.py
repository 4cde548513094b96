"""fsdp-course: the support library of a course that teaches Fully Sharded Data Parallel by building it.

Ranks run as threads inside one notebook (`run_ranks`), each with a real Gloo process group; the
same code runs unchanged in real processes under `torchrun` (`RankContext.from_env`). See
README.md for the lessons, and arXiv:2304.11277 (PyTorch FSDP) and arXiv:1910.02054 (ZeRO).
"""

from fsdp_course.context import RankContext
from fsdp_course.ledger import Ledger, Record
from fsdp_course.monitor import CollectiveHang, CollectiveMismatch, PeerFailed
from fsdp_course.simulate import RankError, run_ranks

__all__ = [
    "CollectiveHang",
    "CollectiveMismatch",
    "Ledger",
    "PeerFailed",
    "RankContext",
    "RankError",
    "Record",
    "run_ranks",
]
__version__ = "0.1.0"
