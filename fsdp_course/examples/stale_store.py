"""Lesson 10, a fixed store path: the next run's rank 0 opens the store a killed run left, before its peer starts.

`python -m fsdp_course.examples.stale_store STORE` prints whether the old keys were there and how rank 0 failed."""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from fsdp_course.runtime.context import article_gloo_group


def main(store_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    store.set_timeout(datetime.timedelta(seconds=2))
    print("keys 0/0 and 0/1 (the two ranks' addresses) there before this run wrote any:", store.check(["0/0", "0/1"]))
    try:
        article_gloo_group(store, 0, 2, seconds=0.5)        # rank 0 of 2, rank 1 not started yet (Gloo tries to
                                                            # connect for a few times 0.5 s)
        print("rank 0 joined")
    except RuntimeError as err:                             # refused, or timed out: it depends on timing
        mesh = "Gloo connectFullMesh failed" in str(err)
        print("rank 0 failed:", "Gloo connectFullMesh failed" if mesh else str(err).splitlines()[0])
    sys.stdout.flush()
    os._exit(0)                                             # leave at once: no clean-up of the half-built group


if __name__ == "__main__":
    main(*sys.argv[1:])
