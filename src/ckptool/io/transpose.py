"""Transposes over the cores, for GPT-2's Conv1D layout ([in, out] where Megatron stores [out, in]).

`x.t().contiguous()` runs on one core at well under memory speed (a strided read of every
element): profiled on the 16-core device machine, to-hf spent 13.4 of its 44 s in it. Here the
input is cut into blocks of rows that a pool of threads transposes in
parallel (torch releases the GIL in copy_): each thread transposes a contiguous block of input
rows with torch's own cache-blocked transpose, then copies it into its columns of the output.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from . import chunked, profile
from .buffers import empty

_SERIAL_BELOW = 1 << 20  # elements: smaller transposes are not worth a round trip through the pool
_pool = None
_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """A pool of its own: on the checksum pool, a layer's transpose blocks would queue ahead of the
    writer's hash pieces, and the writer would wait for the next tensor's transposes."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(2, chunked.workers()), thread_name_prefix="ckptool-T")
        return _pool


def transposed_cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, 0).t().contiguous() for 2-D parts, without the intermediate cat."""
    cols = parts[0].shape[1]
    rows = sum(p.shape[0] for p in parts)
    with profile.stage("transform"):
        if rows * cols < _SERIAL_BELOW:
            return torch.cat(list(parts), 0).t().contiguous()
        out = empty((cols, rows), parts[0].dtype)
        height = max(64, -(-rows // (4 * chunked.workers())) // 64 * 64)  # ~4 blocks per thread
        jobs, first = [], 0
        for part in parts:
            part = part.contiguous()
            for a in range(0, part.shape[0], height):
                b = min(part.shape[0], a + height)
                jobs.append(_threads().submit(_copy, out[:, first + a:first + b], part[a:b]))
            first += part.shape[0]
        for job in jobs:
            job.result()
        return out


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous() for a 2-D x, in parallel blocks."""
    return transposed_cat([x])


def _copy(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """dst (a column block of the output) = rows.t(): torch's blocked transpose of the contiguous
    row block into a small buffer, then a copy of contiguous runs into dst's rows."""
    with profile.stage("transform"):
        dst.copy_(rows.t().contiguous())
