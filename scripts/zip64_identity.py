#!/usr/bin/env python3
"""Byte-identity of ckptool's parallel-checksum torch archives (ckptool/io/torchzip.py) with torch's
own writer where zip64 matters: a record larger than 4 GiB and records past offset 4 GiB.
Needs ~10 GB of memory and 2 x 5 GB of disk, so it is a script (run on a large host), not a test.

    python scripts/zip64_identity.py DIR
"""
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptool.io import torchfile, torchzip  # noqa: E402
from ckptool.lazy import Const  # noqa: E402


def write(path: Path, obj, parallel: bool) -> None:
    real = torchzip.supported
    torchzip.supported = lambda: parallel and real()
    try:
        w = torchfile.StreamingTorchWriter(path, obj)
        for ps in w.pending:
            w.write(ps)
        w.finish()
    finally:
        torchzip.supported = real


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(64 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0, 255, (1 << 24,), dtype=torch.uint8, generator=g)
    huge = block.repeat(275)  # 4.6 GB: one record over 4 GiB
    obj = {"huge": Const(huge), "after": Const(torch.randn(1 << 20, generator=g)),
           "tiny": Const(torch.arange(5)), "iteration": 1}
    write(out / "ours.pt", obj, True)
    write(out / "torch.pt", obj, False)
    a, b = sha256(out / "ours.pt"), sha256(out / "torch.pt")
    print(f"zip64 identity: ours {a[:16]} torch {b[:16]} -> {'IDENTICAL' if a == b else 'DIFFERENT'}")
    loaded = torch.load(out / "ours.pt", weights_only=True, mmap=True)
    print("torch.load:", loaded["tiny"].tolist(), bool(torch.equal(loaded["after"], obj["after"].tensor)))
    return 0 if a == b else 1


if __name__ == "__main__":
    sys.exit(main())
