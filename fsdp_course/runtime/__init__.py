"""The simulated cluster (floor 1): ranks as threads, each with a real Gloo process group over one FileStore.

  simulate.py     run_ranks: one thread per rank, errors gathered as RankError
  context.py      RankContext: rank, world size, group, RNG, ledger; the collectives as methods; from_env()
  collectives.py  broadcast, all_reduce, all_gather, reduce_scatter, barrier, send/recv over the real group;
                  all_gather and reduce_scatter also with async_op=True (CollectiveWork)
  monitor.py      the referee: compares every collective across ranks, names mismatches, hangs and deadlocks
  ledger.py       the traffic ledger (ring cost model) and the per-step traffic formulas
  cost_model.py   the α–β model: collectives timed on simulated ranks, fit of α and β, predict()
  timing.py       intervals of compute and communication: how long a collective ran under compute
  output.py       per-rank prints, replayed in rank order
  ports.py        free TCP ports (torchrun, JupyterLab) and the kernels' transport
"""

from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Ledger, Record
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch, PeerFailed
from fsdp_course.runtime.simulate import RankError, run_ranks

__all__ = ["CollectiveHang", "CollectiveMismatch", "Ledger", "PeerFailed", "RankContext", "RankError", "Record",
           "run_ranks"]
