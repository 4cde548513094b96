"""Lesson 10, a fixed store path: two ranks meet through a FileStore, then the process is killed, as by Ctrl-C.

`python -m fsdp_course.examples.killed_run STORE` exits 130 and leaves STORE behind, its keys still in it."""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist

from fsdp_course.runtime.context import gloo_group


def rank(r: int, store_path: str, alive: list) -> None:
    store = dist.FileStore(store_path, 2)      # new FileStore(masterAddr, worldSize)
    group = gloo_group(store, r, 2, 5.0)       # new ProcessGroupGloo(store, rank, worldSize, options)
    group.allreduce([torch.ones(1)]).wait()
    alive.extend([store, group])               # still in use when the process is killed


def main(store_path: str) -> None:
    alive: list = []
    threads = [threading.Thread(target=rank, args=(r, store_path, alive)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os._exit(130)                              # killed: no clean-up runs, the store file stays


if __name__ == "__main__":
    main(*sys.argv[1:])
