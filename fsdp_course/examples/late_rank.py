"""Lesson 10, the article's 5-second timeout: two ranks built as the article builds them, one of them late.

`python -m fsdp_course.examples.late_rank STORE` prints one line per rank: the error it stopped with, or none."""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from fsdp_course.runtime.context import article_gloo_group


def rank(r: int, store_path: str, errors: dict[int, str]) -> None:
    group = article_gloo_group(dist.FileStore(store_path, 2), r, 2, seconds=10)  # 10 s: a loaded machine connects
    group._set_default_timeout(datetime.timedelta(seconds=1.0))  # slowly; the collectives': the article's 5 s, scaled
    if r == 1:
        time.sleep(2.0)                                          # rank 1 is late: a slower step
    try:
        group.allreduce([torch.ones(1)]).wait()
    except RuntimeError as err:
        errors[r] = str(err).splitlines()[0].split("] ", 1)[-1]


def main(store_path: str) -> None:
    errors: dict[int, str] = {}
    threads = [threading.Thread(target=rank, args=(r, store_path, errors)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        print(f"rank {r}: {errors.get(r, 'no error')}")
    sys.stdout.flush()
    os._exit(0)                                                  # leave at once: no clean-up of the broken group


if __name__ == "__main__":
    main(*sys.argv[1:])
