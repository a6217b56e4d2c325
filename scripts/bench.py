#!/usr/bin/env python3
"""Conversion throughput and memory, side by side with the copy limit and the peers.

    python scripts/bench.py [--size-gb 2] [--out DIR] [--keep] [--steps copy,merge,...]

Writes a synthetic GPT-2-style Megatron checkpoint (TP2 PP2, bf16, ~SIZE GB, layer by layer so
it may exceed memory), then runs each step as a child process and prints a markdown table:
wall time, MB/s of checkpoint bytes, throughput as a fraction of `cp -r` + `sync` of the same
files (the limit: a conversion reads and writes every byte once), and the child's peak resident
memory (GNU time's max RSS: for torchrun, the largest single process of the tree).
Every step's output is fsynced (ckptool seals its output with fsync; the copy runs `sync`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

STEPS = ("copy", "merge", "reshard", "to-hf", "torchrun", "transformers", "deepspeed")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def ckptool_commands() -> set:
    out = subprocess.run([sys.executable, "-m", "ckptool", "--help"], capture_output=True, text=True,
                         env=_env()).stdout
    cmds, listing = set(), False
    for line in out.splitlines():
        if line.strip().startswith("Commands:"):
            listing = True
        elif listing and line.startswith("  ") and line.strip():
            cmds.add(line.split()[0])
    return cmds


def timed(cmd: list, log: Path) -> dict:
    """Run cmd under GNU time (or rusage when absent): wall seconds, peak RSS bytes, rc."""
    stats = log.with_suffix(".time")
    if Path("/usr/bin/time").exists():
        full = ["/usr/bin/time", "-o", str(stats), "-f", "%e %M"] + cmd
    else:
        full = cmd
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(full, stdout=f, stderr=subprocess.STDOUT, env=_env()).returncode
    wall = time.perf_counter() - start
    if stats.exists() and stats.read_text().split():
        last = stats.read_text().split("\n")[-2].split()
        rss = int(last[1]) * 1024
    else:
        import resource
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # max over all children so far
    return {"wall": wall, "rss": rss, "rc": rc, "log": log}


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def transformers_script_status() -> str:
    try:
        import transformers
    except ImportError:
        return "transformers not installed"
    script = Path(transformers.__file__).parent / "models" / "megatron_gpt2" / \
        "checkpoint_reshaping_and_interoperability.py"
    if not script.exists():
        return (f"not shipped: transformers {transformers.__version__} has no "
                "models/megatron_gpt2/checkpoint_reshaping_and_interoperability.py")
    return str(script)


def deepspeed_status() -> str:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # deepspeed raises more than ImportError when half installed
        return f"deepspeed not importable ({type(e).__name__})"
    return ("deepspeed is installed, but zero_to_fp32 needs a ZeRO checkpoint with fp32 optimizer "
            "state (~8x the bf16 weights); this bench does not build one yet")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size (1e9 bytes)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list out of {','.join(STEPS)}")
    ap.add_argument("--nproc", type=int, default=2, help="processes for the torchrun step")
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        ap.error(f"unknown steps {bad}")

    work = args.out or Path(tempfile.mkdtemp(prefix="ckptool-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    from synthetic import write_synthetic
    if src.exists():
        shutil.rmtree(src)
    t0 = time.perf_counter()
    cfg = write_synthetic(src, args.size_gb)
    gen = time.perf_counter() - t0
    size = dir_bytes(src)
    biggest_layer = 2 * max(cfg.padded_vocab_size * cfg.hidden_size, 12 * cfg.hidden_size ** 2)
    subprocess.run(["sync"])
    print(f"synthetic checkpoint: {size / 1e9:.2f} GB, {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, TP2 PP2 bf16, written in {gen:.0f} s; largest layer "
          f"{biggest_layer / 2**20:.0f} MiB", flush=True)

    have = ckptool_commands()
    py = [sys.executable, "-m", "ckptool"]
    plan = {
        "copy": ("`cp -r` + `sync` (the limit)", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src)]),
        "merge": ("ckptool merge (TP1 PP1)", py + ["merge", str(src)]),
        "reshard": ("ckptool reshard --tp 4 --pp 1", py + ["reshard", str(src), "{dst}", "--tp", "4"]),
        "to-hf": ("ckptool to-hf", py + ["to-hf", str(src)] if "to-hf" in have else None),
        "torchrun": (f"torchrun --nproc-per-node {args.nproc} ckptool reshard --tp 4",
                     ["torchrun", "--nproc-per-node", str(args.nproc), "-m", "ckptool", "reshard",
                      str(src), "{dst}", "--tp", "4"]),
        "transformers": ("transformers megatron reshaping script", None),
        "deepspeed": ("DeepSpeed zero_to_fp32", None),
    }
    reasons = {"to-hf": "n/a (not available): this ckptool has no `to-hf` command",
               "transformers": "n/a: " + transformers_script_status(),
               "deepspeed": "n/a: " + deepspeed_status()}
    rows, copy_rate = [], None
    for step in steps:
        label, cmd = plan[step]
        if cmd is None:
            rows.append((label, reasons[step]))
            continue
        dst = work / f"out-{step}"
        if dst.exists():
            shutil.rmtree(dst)
        cmd = [c.replace("{dst}", str(dst)) for c in cmd]
        if "{dst}" not in " ".join(plan[step][1]):
            cmd = cmd + [str(dst)]
        r = timed(cmd, work / f"{step}.log")
        if r["rc"] != 0:
            tail = r["log"].read_text()[-300:].strip().splitlines()
            rows.append((label, f"FAILED (exit {r['rc']}): {tail[-1] if tail else ''}"))
        else:
            rate = size / r["wall"] / 1e6
            if step == "copy":
                copy_rate = rate
            ratio = f"{rate / copy_rate:.2f}x" if copy_rate else "-"
            rows.append((label, f"{r['wall']:.1f} s | {rate:.0f} | {ratio} | {r['rss'] / 2**20:.0f} MiB"))
        print(f"  {step}: {rows[-1][1]}", flush=True)
        if not args.keep:
            shutil.rmtree(dst, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)

    load = os.getloadavg()
    print()
    print(f"Checkpoint: {size / 1e9:.2f} GB ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"TP2 PP2, bf16); largest layer {biggest_layer / 2**20:.0f} MiB; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end")
    print()
    print("| step | wall | MB/s | vs copy | peak RSS |")
    print("|---|---|---|---|---|")
    for label, cells in rows:
        if cells.count("|") == 3:
            print(f"| {label} | {cells} |")
        else:
            print(f"| {label} | {cells} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
