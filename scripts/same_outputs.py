#!/usr/bin/env python3
"""Do two trees of ckptool write the same outputs, bit for bit? (issue 29: restructuring, behaviour unchanged)

    python3 scripts/same_outputs.py write TREE OUT      # run the commands with TREE/src, outputs under OUT
    python3 scripts/same_outputs.py compare BEFORE AFTER  # compare two OUT trees file by file (sha256)
    python3 scripts/same_outputs.py both OLD_TREE NEW_TREE [--work DIR]   # write both, then compare

A TREE is a checkout of ckptool (its package under TREE/src); an old commit can be checked out with
`git archive COMMIT | tar -x -C DIR`. The commands (COMMANDS below) run on the real checkpoints in
fixtures/real/*/checkpoint: merge, reshards to torch and torch_dist, merge to ds-universal, the
distributed optimizer, fix-vocab, to-hf and from-hf of that export. Each command's exit status and
messages (stdout and stderr, paths replaced by placeholders) are kept beside its output, so a refusal
that changed counts as a difference too. Every file is compared by sha256, except the manifest's
"created" time, which is left out (the manifest's digests of the other files are compared).
Exit status 0 when everything is the same, 1 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real"
MEGATRON_SOURCES = ("mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2")
DEEPSPEED_SOURCES = ("mds_gpt2_pipe_tp2pp2_bf16_zero1",)
MANIFEST = "ckptool-manifest.json"

# (output name, ckptool arguments): {src} is the case's checkpoint, {out} the output, {tmp} the case's
# output folder (for commands reading an earlier output). Run in order.
COMMANDS: Tuple[Tuple[str, str], ...] = (
    ("merge", "merge {src} {out}"),
    ("merge_bf16_release", "merge {src} {out} --dtype bf16 --release"),
    ("merge_no_optimizer", "merge {src} {out} --no-optimizer"),
    ("reshard_tp1pp2", "reshard {src} {out} --tp 1 --pp 2"),
    ("reshard_tp2_divisible", "reshard {src} {out} --tp 2 --make-vocab-size-divisible-by 64 --pad-fill mean"),
    ("reshard_dist", "reshard {src} {out} --tp 1 --format torch_dist"),
    ("reshard_dist_bf16", "reshard {src} {out} --tp 2 --format torch_dist --dtype bf16"),
    ("merge_universal", "merge {src} {out} --format ds-universal"),
    ("merge_distopt_dp2", "merge {src} {out} --distributed-optimizer --dp 2"),
    ("reshard_distopt_era", "reshard {src} {out} --tp 2 --distributed-optimizer --dp 2 --distrib-optim-era 2024-02"),
    ("fix_vocab", "fix-vocab {src} {out} --multiple 64"),
    ("to_hf", "to-hf {src} {out}"),
    ("from_hf", "from-hf {tmp}/to_hf {out} --tp 2"),
    ("from_hf_legacy", "from-hf {tmp}/to_hf {out} --dialect legacy --pp 2"),
    ("merge_of_dist", "merge {tmp}/reshard_dist {out} --format torch"),
    # options the target cannot honour (refused or not: the messages are compared too)
    ("dist_distopt", "reshard {src} {out} --tp 1 --format torch_dist --distributed-optimizer"),
    ("dist_grouped_gemm", "reshard {src} {out} --tp 1 --format torch_dist --moe-grouped-gemm"),
)


def cases() -> List[Tuple[str, Path]]:
    return [(name, FIXTURES / name / "checkpoint") for name in MEGATRON_SOURCES + DEEPSPEED_SOURCES]


def write(tree: Path, out: Path) -> None:
    """Run every command of every case with tree's ckptool; outputs and messages under out."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"))
    for case, src in cases():
        folder = out / case
        folder.mkdir(parents=True, exist_ok=True)
        for name, args in COMMANDS:
            dst = folder / name
            argv = args.format(src=src, out=dst, tmp=folder).split()
            done = subprocess.run([sys.executable, "-m", "ckptool", *argv], env=env, capture_output=True, text=True)
            said = (done.stdout + done.stderr).replace(str(folder), "{tmp}").replace(str(src), "{src}")
            (folder / f"{name}.messages.txt").write_text(f"exit {done.returncode}\n{said}")
            print(f"{case} {name}: exit {done.returncode}", flush=True)


def digests(root: Path) -> Dict[str, str]:
    """relative path -> sha256 of every file under root (a manifest without its creation time)."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == MANIFEST:
            doc = json.loads(data)
            doc.pop("created", None)  # the time of the write, the one thing that must differ
            data = json.dumps(doc, sort_keys=True).encode()
        out[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def compare(before: Path, after: Path) -> bool:
    a, b = digests(before), digests(after)
    differ = [p for p in sorted(set(a) & set(b)) if a[p] != b[p]]
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    for what, paths in (("differs", differ), (f"only in {before}", only_a), (f"only in {after}", only_b)):
        for p in paths:
            print(f"{what}: {p}")
    same = not (differ or only_a or only_b)
    print(f"{len(a)} files before, {len(b)} after: {'SAME' if same else 'DIFFERENT'} "
          f"({len(differ)} differ, {len(only_a)} only before, {len(only_b)} only after)")
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write")
    w.add_argument("tree", type=Path)
    w.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    b = sub.add_parser("both")
    b.add_argument("old_tree", type=Path)
    b.add_argument("new_tree", type=Path)
    b.add_argument("--work", type=Path, default=Path("/tmp/same-outputs"))
    a = ap.parse_args()
    if a.what == "write":
        write(a.tree, a.out)
        return 0
    if a.what == "both":
        write(a.old_tree, a.work / "before")
        write(a.new_tree, a.work / "after")
        a.before, a.after = a.work / "before", a.work / "after"
    return 0 if compare(a.before, a.after) else 1


if __name__ == "__main__":
    sys.exit(main())
