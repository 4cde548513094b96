"""Test-session settings: one intra-op thread per process.

Rank threads share torch's intra-op thread pool; with two pytest workers on two cores, extra
intra-op threads only fight each other (a one-process reference run went from 0.07 s to 2.6 s).
"""

import torch

torch.set_num_threads(1)
