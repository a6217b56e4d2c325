"""The floor under any merge on this machine: the cost of only moving a checkpoint's tensor bytes
into one merged file, leaving out everything else a real converter has to do.

Every tensor record of every torch archive under SRC is copied in the kernel (os.copy_file_range,
with no pass through user space) end to end into DST/merged.bin, and then synced like bench.py's
copy step. There is no torch import, no interleaving of row-parallel halves, no pickle, zip header
or manifest. --hash adds the one pass ckptool's manifest cannot do without, sha256 of the output, on a second
thread beside the copy as ckptool does it.

bench.py times this as its "ceiling" steps. No merge can be faster, so the ratio of this step to
`cp -r` + `sync` is an upper bound on what any converter's ratio can be here.

    python scripts/copy_ceiling.py SRC DST [--hash]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import struct
import sys
import zipfile
from pathlib import Path

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes


def tensor_records(archive: Path) -> list:
    """(offset, size) of each stored tensor record (".../data/N") in a torch zip archive."""
    out = []
    with zipfile.ZipFile(archive) as z, open(archive, "rb") as f:
        for info in z.infolist():
            if "/data/" not in info.filename or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            name_len, extra_len = fields[-2], fields[-1]
            out.append((info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size))
    return out


def plan(src: Path) -> list:
    """(archive, offset, size) of every tensor record under src, in output order."""
    return [(a, off, size) for a in sorted(src.rglob("*.pt")) for off, size in tensor_records(a)]


def copy_records(records: list, dst_file: Path) -> int:
    fd = os.open(dst_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    pos = 0
    try:
        for archive, offset, size in records:
            sfd = os.open(archive, os.O_RDONLY)
            try:
                done = 0
                while done < size:
                    n = os.copy_file_range(sfd, fd, size - done, offset + done, pos + done)
                    if n == 0:
                        raise OSError(f"short copy from {archive}")
                    done += n
            finally:
                os.close(sfd)
            pos += size
    finally:
        os.close(fd)
    return pos


def sha256_of_records(records: list) -> str:
    """sha256 of the merged file, taken from the source ranges (the merged file is exactly their
    concatenation), so it can run on the other core while the kernel copies."""
    h = hashlib.sha256()
    for archive, offset, size in records:
        with open(archive, "rb") as f:
            f.seek(offset)
            left = size
            while left:
                chunk = f.read(min(left, 64 << 20))
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--hash", action="store_true", help="also sha256 the output, as ckptool's manifest does")
    args = ap.parse_args(argv)
    args.dst.mkdir(parents=True)
    out = args.dst / "merged.bin"
    records = plan(args.src)
    if not records:
        print(f"no tensor records found under {args.src}", file=sys.stderr)
        return 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # hashlib and copy_file_range drop the GIL
        digest = pool.submit(sha256_of_records, records) if args.hash else None
        size = copy_records(records, out)
        if digest is not None:
            (args.dst / "merged.bin.sha256").write_text(digest.result() + "\n")
    os.sync()
    print(f"{size / 1e9:.2f} GB of tensor records copied into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
