"""Tensors loaded on a background thread while the caller writes the ones before them.

A writer that streams one long record from many tensors (a distrib_optim.pt flat buffer, built a
parameter at a time) would otherwise read, merge and check each tensor, then write it, then read the
next: the disk and the cores idle by turns. `loaded_ahead` overlaps the two: one thread loads the
next tensors (reads release the GIL, as do torch's copies and casts) while the caller writes, never
holding more than `limit` bytes of loaded tensors beside the one the caller has (at least one is
always allowed, however large). The source bytes of the tensors after those are asked for early
through a read-ahead (io/prefetch.py), so cold reads are in flight before the loader needs them.
"""
from __future__ import annotations

import collections
import threading
from typing import Iterator, Optional, Sequence

import torch

from ..lazy import LazyTensor
from . import profile
from .prefetch import Prefetcher


def loaded_ahead(lazies: Sequence[LazyTensor], limit: int, ahead: Optional[Prefetcher] = None
                 ) -> Iterator[torch.Tensor]:
    """Each lazy's load(), in order, loaded up to `limit` bytes ahead on a background thread; ahead
    (optional) is asked for each tensor's source bytes as the one before it starts loading. A load's
    error is raised here, where its tensor would have come; closing the iterator early stops the
    thread."""
    done = collections.deque()  # loaded, not yet taken: (bytes, tensor or None, error or None)
    cond = threading.Condition()
    state = {"held": 0, "stop": False}

    def load_all() -> None:
        for i, lazy in enumerate(lazies):
            n = lazy.nbytes
            with cond:  # room for it: nothing loaded waiting, or it fits under the limit
                cond.wait_for(lambda: state["stop"] or not done or state["held"] + n <= limit)
                if state["stop"]:
                    return
                state["held"] += n
            if ahead is not None and i + 1 < len(lazies):
                ahead.ask([lazies[i + 1]])
            try:
                item = (lazy.load(), None)
            except BaseException as e:  # handed to the caller, which raises it
                item = (None, e)
            with cond:
                done.append((n,) + item)
                cond.notify_all()
            if item[1] is not None:
                return

    if ahead is not None and lazies:
        ahead.ask([lazies[0]])
    thread = threading.Thread(target=load_all, name="ckptool-load-ahead", daemon=True)
    thread.start()
    try:
        for _ in range(len(lazies)):
            with profile.stage("wait"), cond:
                cond.wait_for(lambda: done)
                n, tensor, error = done.popleft()
            if error is not None:
                raise error
            yield tensor
            del tensor
            with cond:  # the caller is done with it: its bytes are free for the loader
                state["held"] -= n
                cond.notify_all()
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        thread.join()
