#!/usr/bin/env python3
"""x.t().contiguous() against ckptool's parallel blocked transpose (io/transpose.py), 4096 x 16384 bf16."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptool.io.transpose import transposed  # noqa: E402

x = torch.randn(4096, 16384).to(torch.bfloat16)
for _ in range(3):
    t = time.perf_counter(); a = x.t().contiguous(); t1 = time.perf_counter() - t
    t = time.perf_counter(); b = transposed(x); t2 = time.perf_counter() - t
    print(f"transpose 128 MiB: torch {t1 * 1e3:.0f} ms, ckptool {t2 * 1e3:.0f} ms, equal {torch.equal(a, b)}")
