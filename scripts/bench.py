#!/usr/bin/env python3
"""Conversion throughput and memory, side by side with the copy limit and the peers.

    python scripts/bench.py [--size-gb 2] [--style gpt2|llama] [--out DIR] [--keep] [--steps copy,merge,...]
                            [--repeat 3] [--profile]

Writes a synthetic GPT-2-style (or, with --style llama, Llama-style: RoPE, RMSNorm, SwiGLU, no
biases, untied output, so to-hf needs no Conv1D transposes) Megatron checkpoint (TP2 PP2, bf16, ~SIZE GB, layer by layer so
it may exceed memory), then runs each step as a child process, each time right after a `cp -r` +
`sync` of the same files (the limit: a conversion reads and writes every byte once), for --repeat
rounds, and prints a markdown table of medians: wall time, MB/s of checkpoint bytes, the step's
throughput as a fraction of the copy run just before it, and the child's peak resident memory (GNU
time's max RSS: for torchrun, the largest single process of the tree). Peers: DeepSpeed's
zero_to_fp32 against ckptool on a real ZeRO-2 checkpoint (scripts/ds_zero_case.py), and the
transformers Megatron GPT-2 script where the installed transformers still ships it. The
"ceiling" steps are not conversions but the floor under one (scripts/copy_ceiling.py): the same
tensor bytes copied in the kernel into one file, without torch, with and without the manifest's
sha256; no converter can beat them, so their ratio bounds every other row's.
Every step's output is fsynced (ckptool seals its output with fsync; the copy runs `sync`).
--cache cold (root) drops the page cache before every timed command, so copy and conversion both
read the source from the disk (warm: read into the cache first; as-is, the default: sync only);
--variants 'NAME:VAR=VALUE,...;NAME2:' runs every ckptool step once per environment (an A/B in one
run; a step's variants share the copy before them each round and take turns going first);
--launcher ckptool starts the torchrun steps with `python -m ckptool.torchrun`.
--profile runs the ckptool steps with CKPTOOL_PROFILE=1 and prints, for each, where the last
round's time went stage by stage (ckptool/io/profile.py: thread-seconds per stage, summed over the
processes of a torchrun step).
"""
from __future__ import annotations

import argparse
import contextlib
import json
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

STEPS = ("copy", "ceiling", "ceiling-hash", "merge", "reshard", "to-hf", "torchrun", "torchrun-to-hf",
         "transformers", "deepspeed")
# with --optimizer: the state written as distrib_optim.pt at TP1, the whole model in one rank's flat buffers
OPTIMIZER_STEPS = ("merge-distopt",)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
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


def _disk_sectors() -> tuple:
    """(sectors read, sectors written) so far over the whole disks (/proc/diskstats; partitions,
    loop and ram devices left out so no byte counts twice)."""
    disks = {d for d in os.listdir("/sys/block") if not d.startswith(("loop", "ram", "dm-", "md"))}
    rd = wr = 0
    with open("/proc/diskstats") as f:
        for line in f:
            x = line.split()
            if len(x) > 9 and x[2] in disks:
                rd += int(x[5])
                wr += int(x[9])
    return rd, wr


class DiskTrace:
    """Disk read and write throughput during one timed command, per PERIOD seconds (--disk-trace):
    shows whether the disk is kept busy the whole time or idles while the converter computes."""
    PERIOD = 0.5

    def __init__(self):
        import threading
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last = _disk_sectors()
        while not self._stop.wait(self.PERIOD):
            now = _disk_sectors()
            self.samples.append(((now[0] - last[0]) * 512, (now[1] - last[1]) * 512))
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        mb = lambda b: f"{b / self.PERIOD / 1e6:.0f}"
        return (f"disk MB/s every {self.PERIOD} s, read: " + " ".join(mb(r) for r, _ in self.samples)
                + "\n    write: " + " ".join(mb(w) for _, w in self.samples))


TRACE_DISK = False


def timed(cmd: list, log: Path, env: dict = None) -> dict:
    """Run cmd under GNU time (or rusage when absent): wall seconds, peak RSS bytes, rc (and, with
    TRACE_DISK, the disk's throughput over the run)."""
    stats = log.with_suffix(".time")
    if Path("/usr/bin/time").exists():
        full = ["/usr/bin/time", "-o", str(stats), "-f", "%e %M"] + cmd
    else:
        full = cmd
    trace = DiskTrace() if TRACE_DISK else None
    start = time.perf_counter()
    with open(log, "w") as f, (trace or contextlib.nullcontext()):
        rc = subprocess.run(full, stdout=f, stderr=subprocess.STDOUT, env=dict(_env(), **(env or {}))).returncode
    wall = time.perf_counter() - start
    if stats.exists() and stats.read_text().split():
        last = stats.read_text().split("\n")[-2].split()
        rss = int(last[1]) * 1024
    else:
        import resource
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # max over all children so far
    return {"wall": wall, "rss": rss, "rc": rc, "log": log, "disk": trace.summary() if trace else None}


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def transformers_script_status() -> str:
    try:
        import transformers
    except ImportError:
        return "transformers not installed"
    folder = Path(transformers.__file__).parent / "models" / "megatron_gpt2"
    scripts = [folder / "convert_megatron_gpt2_checkpoint.py",
               folder / "checkpoint_reshaping_and_interoperability.py"]
    found = [str(x) for x in scripts if x.exists()]
    if not found:
        return (f"not shipped: transformers {transformers.__version__} has no models/megatron_gpt2 "
                "(neither convert_megatron_gpt2_checkpoint.py nor checkpoint_reshaping_and_interoperability.py)")
    return found[0]


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def read_profiles(log: Path) -> list:
    """The ckptool-profile lines a step's processes printed (ckptool/io/profile.py)."""
    out, text, tag = [], log.read_text(errors="replace"), "ckptool-profile "
    decoder = json.JSONDecoder()
    at = text.find(tag)
    while at >= 0:  # anywhere in a line: another process may have written before the newline
        try:
            out.append(decoder.raw_decode(text, at + len(tag))[0])
        except ValueError:
            pass
        at = text.find(tag, at + len(tag))
    return out


def print_profiles(profiles: dict, plan: dict) -> None:
    """One table: a column per step, a row per stage (thread-seconds), then wall and CPU."""
    from ckptool.io.profile import STAGES
    steps = [s for s in profiles if profiles[s]]
    if not steps:
        return
    def total(step, key):
        return sum(p[key] for p in profiles[step])
    print()
    print("Where the time goes (last round; thread-seconds per stage, summed over threads and processes;")
    print("stages overlap in parallel threads, so a column can add up to more than the wall time):")
    print()
    print("| stage | " + " | ".join(plan[s][0] for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    names = list(STAGES) + sorted({k for s in steps for p in profiles[s] for k in p["stages"]} - set(STAGES))
    for name in names:
        cells = []
        for s in steps:
            v = sum(p["stages"].get(name, [0, 0])[0] for p in profiles[s])
            cells.append(f"{v:.1f}" if v else "")
        if any(cells):
            print(f"| {name}: {STAGES.get(name, '')} | " + " | ".join(cells) + " |")
    print("| wall of the slowest process | " + " | ".join(f"{max(p['wall'] for p in profiles[s]):.1f}"
                                                      for s in steps) + " |")
    print("| CPU user + system (all processes) | " + " | ".join(
        f"{total(s, 'cpu_user'):.1f} + {total(s, 'cpu_sys'):.1f}" for s in steps) + " |")


CACHE_MODES = ("as-is", "warm", "cold", "cold-src")


def settle(mode: str, src: Path) -> None:
    """The same start for every timed command: nothing dirty (the previous output's pages and, on a
    disk mounted with `discard`, the trims of its deletion are done: sync), and the source either
    left as the last command left it (as-is), read into the page cache (warm), or dropped from it
    (cold: every byte comes from the disk; needs root, /proc/sys/vm/drop_caches; cold-src: only the
    source's files dropped, with posix_fadvise DONTNEED, for a shared box: torch's own files stay
    cached)."""
    subprocess.run(["sync"])
    if mode == "as-is":
        return
    if mode == "cold-src":  # only the source's pages dropped (no root; other jobs' caches stay)
        for p in sorted(src.rglob("*")):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return
    with open("/proc/sys/vm/drop_caches", "w") as f:  # clean pages only: sync ran just before
        f.write("3\n")
    if mode == "warm":
        buf = bytearray(16 << 20)
        for p in sorted(src.rglob("*")):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def run_side_by_side(plan: dict, steps: list, size: int, work: Path, repeat: int, keep: bool,
                     profiles: dict = None, cache: str = "as-is", src: Path = None) -> list:
    """Each step runs right after its own copy of the same bytes, `repeat` rounds; rows of medians.

    Pairing every run with a copy taken just before it makes the ratio robust to load from other
    jobs on a shared machine (both see about the same load). Before each timed command the
    machine settles (settle(): sync, and the page cache as `cache` says)."""
    copy_cmd = plan["copy"][1]
    walls: dict = {s: [] for s in steps}
    ratios: dict = {s: [] for s in steps}
    rss: dict = {s: 0 for s in steps}
    failed: dict = {}
    for rnd in range(repeat):
        last_copy = (None, None)  # (base step, copy result): variants of one step share one copy a round
        for step in _round_order(plan, steps, rnd):
            label, cmd = plan[step][:2]
            if cmd is None or step in failed:
                continue
            base = plan[step][3] if len(plan[step]) > 3 else step
            pair = [("copy", copy_cmd)] if step != "copy" and last_copy[0] != base else []
            pair.append((step, cmd))
            step_env = plan[step][2] if len(plan[step]) > 2 else None
            measured = {}
            for name, c in pair:
                dst = work / ("out-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name))
                shutil.rmtree(dst, ignore_errors=True)
                c = [x.replace("{dst}", str(dst)) for x in c]
                if name == "copy":  # sh -c 'cp -r "$0" "$1" && sync' SRC DST
                    c = c + [str(dst)]
                settle(cache, src)
                r = timed(c, dst.with_name(dst.name[4:] + ".log"), step_env if name == step else None)
                if r["rc"] != 0:
                    tail = r["log"].read_text()[-300:].strip().splitlines()
                    failed[step] = f"FAILED (exit {r['rc']}): {tail[-1] if tail else ''}"
                    break
                measured[name] = r
                if not keep or rnd < repeat - 1:
                    shutil.rmtree(dst, ignore_errors=True)
            if step in failed:
                print(f"  {step}: {failed[step]}", flush=True)
                continue
            if "copy" in measured:
                last_copy = (base, measured["copy"])
            elif step != "copy":
                measured["copy"] = last_copy[1]
            r = measured[step]
            if profiles is not None:
                profiles[step] = read_profiles(r["log"])
            walls[step].append(r["wall"])
            rss[step] = max(rss[step], r["rss"])
            ratios[step].append(measured["copy"]["wall"] / r["wall"] if "copy" in measured else 1.0)
            said = [f"copy before it {measured['copy']['wall']:.1f} s"] if step != "copy" else []
            profs = read_profiles(r["log"]) if profiles is not None else []
            if profs:  # so a run cut short still tells where its time went
                said.append("startup " + "/".join(f"{p['stages'].get('startup', [0])[0]:.1f}" for p in profs) + " s")
            print(f"  round {rnd + 1} {step}: {r['wall']:.1f} s, {ratios[step][-1]:.2f}x copy, "
                  f"{r['rss'] / 2**20:.0f} MiB" + (f" ({'; '.join(said)})" if said else ""), flush=True)
            for name, _ in pair:
                if measured[name].get("disk"):
                    print(f"    {name}: {measured[name]['disk']}", flush=True)
    rows = []
    for step in steps:
        label, cmd = plan[step][:2]
        if cmd is None:
            rows.append((label, plan.get("_reasons", {}).get(step, "n/a")))
        elif step in failed:
            rows.append((label, failed[step]))
        else:
            wall = median(walls[step])
            rows.append((label, f"{wall:.1f} s | {size / wall / 1e6:.0f} | {median(ratios[step]):.2f}x | "
                                f"{rss[step] / 2**20:.0f} MiB"))
    return rows


def _round_order(plan: dict, steps: list, rnd: int) -> list:
    """Steps in their order, the variants of one step reversed in odd rounds: each variant runs
    first after the shared copy as often as second, so neither always meets the state the other
    left (write-back still under way, a warmer cache of the code)."""
    out, i = [], 0
    while i < len(steps):
        base = plan[steps[i]][3] if len(plan[steps[i]]) > 3 else None
        j = i + 1
        while base is not None and j < len(steps) and len(plan[steps[j]]) > 3 and plan[steps[j]][3] == base:
            j += 1
        out.extend(reversed(steps[i:j]) if rnd % 2 else steps[i:j])
        i = j
    return out


def print_table(rows):
    print("| step | wall (median) | MB/s | vs copy (median of pairs) | peak RSS |")
    print("|---|---|---|---|---|")
    for label, cells in rows:
        if cells.count("|") == 3:
            print(f"| {label} | {cells} |")
        else:
            print(f"| {label} | {cells} | | | |")


def deepspeed_rows(args, work: Path) -> tuple:
    """zero_to_fp32 against ckptool on one real ZeRO-2 checkpoint (its own copy limit)."""
    ckpt = args.ds_ckpt or work / "ds"
    if not (Path(ckpt) / "latest").exists():
        env = dict(_env(), DS_ACCELERATOR="cpu")
        r = subprocess.run(["torchrun", "--nproc-per-node", "2", str(ROOT / "scripts" / "ds_zero_case.py"),
                            str(ckpt)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            return None, [("DeepSpeed zero_to_fp32", "n/a: could not write the ZeRO checkpoint: "
                           + (r.stderr.strip().splitlines() or ["?"])[-1])]
    subprocess.run(["sync"])
    size = dir_bytes(ckpt)
    # torch .bin output: its safetensors output refuses GPT-2's tied (shared) embedding
    z2f = ("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
           "import sys; c(sys.argv[1], sys.argv[2])")
    py = [sys.executable, "-m", "ckptool"]
    plan = {
        "copy": ("`cp -r` + `sync` (the limit)", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(ckpt)]),
        "zero_to_fp32": ("DeepSpeed convert_zero_checkpoint_to_fp32_state_dict (fp32 pytorch_model.bin)",
                         [sys.executable, "-c", z2f, str(ckpt), "{dst}"]),
        "ds-to-hf": ("ckptool to-hf (fp32 masters -> safetensors)", py + ["to-hf", str(ckpt), "{dst}"]),
    }
    rows = run_side_by_side(plan, list(plan), size, work, args.repeat, False)
    return size, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size (1e9 bytes)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list out of {','.join(STEPS)}")
    ap.add_argument("--nproc", type=int, default=2, help="processes for the torchrun steps")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of (copy, step) pairs; medians reported")
    ap.add_argument("--style", choices=("gpt2", "llama", "moe"), default="gpt2",
                    help="synthetic source: GPT-2 style (to-hf transposes Conv1D), Llama style (no transposes) "
                         "or moe (Llama style, every MLP 8 experts, top 2; written at TP2 PP2 EP2)")
    ap.add_argument("--optimizer", action="store_true",
                    help="the source also holds Megatron's training state (fp32 masters + Adam moments, 6x the "
                         "bf16 weights' bytes; --size-gb counts the weights), carried by merge and reshard; "
                         "allows the step merge-distopt (the state written as one distrib_optim.pt)")
    ap.add_argument("--profile", action="store_true", help="print where each ckptool step's time goes, stage by stage")
    ap.add_argument("--reuse-src", action="store_true", help="keep an existing OUT/src instead of regenerating")
    ap.add_argument("--cache", choices=CACHE_MODES, default="as-is",
                    help="the source's page-cache state before every timed command: as-is (what the last one "
                         "left), warm (read in first), cold (dropped; root only) or cold-src (only the source's "
                         "files dropped: no root, other jobs' caches kept). Every mode syncs first")
    ap.add_argument("--launcher", choices=("torchrun", "ckptool"), default="torchrun",
                    help="torchrun steps start with `torchrun -m ckptool` or `python -m ckptool.torchrun`")
    ap.add_argument("--variants", default="",
                    help="run each ckptool step once per variant (the variants of a step share one copy a round "
                         "and take turns going first): 'NAME:VAR=VALUE,VAR=VALUE;NAME2:' (environment of the "
                         "step's process)")
    ap.add_argument("--disk-trace", action="store_true",
                    help="print the disk's read and write MB/s every half second of each timed command")
    ap.add_argument("--ds-ckpt", type=Path, default=None,
                    help="ZeRO checkpoint for the deepspeed step (default: write one with scripts/ds_zero_case.py)")
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS + (OPTIMIZER_STEPS if args.optimizer else ())]
    if bad:
        ap.error(f"unknown steps {bad}")

    work = args.out or Path(tempfile.mkdtemp(prefix="ckptool-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    from synthetic import largest_layer_bytes, write_synthetic
    if src.exists() and not args.reuse_src:
        shutil.rmtree(src)
    t0 = time.perf_counter()
    if not src.exists():
        # generated beside and renamed when complete, so an interrupted run leaves no src to reuse
        partial = work / "src.partial"
        shutil.rmtree(partial, ignore_errors=True)
        cfg = write_synthetic(partial, args.size_gb, style=args.style, optimizer=args.optimizer)
        partial.rename(src)
    else:
        from ckptool.formats.registry import open_checkpoint
        cfg = open_checkpoint(src).config
    gen = time.perf_counter() - t0
    size = dir_bytes(src)
    # a layer streams with its optimizer slots: 2 bytes (bf16 weight) + 3 x 4 (fp32 master and moments)
    biggest_layer = largest_layer_bytes(cfg, itemsize=14 if args.optimizer else 2)
    style = (("MoE Llama-style" if cfg.moe else "Llama-style") if cfg.gated else "GPT-2-style") + (
        " with optimizer state" if args.optimizer else "")
    grid = "TP2 PP2 EP2" if cfg.moe else "TP2 PP2"
    subprocess.run(["sync"])
    print(f"synthetic {style} checkpoint: {size / 1e9:.2f} GB, {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, {grid} bf16, ready in {gen:.0f} s; largest layer "
          f"{biggest_layer / 2**20:.0f} MiB", flush=True)

    py = [sys.executable, "-m", "ckptool"]
    tr = (["torchrun", "--nproc-per-node", str(args.nproc), "-m", "ckptool"] if args.launcher == "torchrun"
          else [sys.executable, "-m", "ckptool.torchrun", "--nproc-per-node", str(args.nproc)])
    shard = ["--max-shard-size", "500MB"]  # several safetensors files, so torchrun ranks can share them
    plan = {
        "copy": ("`cp -r` + `sync` (the limit)", ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src)]),
        # not conversions: the floor under one (scripts/copy_ceiling.py), no torch, no reordering
        "ceiling": ("in-kernel copy of the tensor records into one file (no torch; the floor)",
                    [sys.executable, str(ROOT / "scripts" / "copy_ceiling.py"), str(src), "{dst}"]),
        "ceiling-hash": ("the same + sha256 of the output (the floor with a manifest)",
                         [sys.executable, str(ROOT / "scripts" / "copy_ceiling.py"), str(src), "{dst}", "--hash"]),
        "merge": ("ckptool merge (TP1 PP1)", py + ["merge", str(src), "{dst}"]),
        "reshard": ("ckptool reshard --tp 4 --pp 1", py + ["reshard", str(src), "{dst}", "--tp", "4", "--pp", "1"]),
        "to-hf": ("ckptool to-hf --max-shard-size 500MB", py + ["to-hf", str(src), "{dst}"] + shard),
        "torchrun": (f"torchrun --nproc-per-node {args.nproc} ckptool reshard --tp 4",
                     tr + ["reshard", str(src), "{dst}", "--tp", "4", "--pp", "1"]),
        "torchrun-to-hf": (f"torchrun --nproc-per-node {args.nproc} ckptool to-hf --max-shard-size 500MB",
                           tr + ["to-hf", str(src), "{dst}"] + shard),
        "merge-distopt": ("ckptool merge --distributed-optimizer --dp 2",
                          py + ["merge", str(src), "{dst}", "--distributed-optimizer", "--dp", "2"]),
        "transformers": ("transformers Megatron GPT-2 conversion script", None),
        "_reasons": {"transformers": "n/a: " + transformers_script_status()},
    }
    main_steps = [s for s in steps if s != "deepspeed"]
    if args.variants:
        variants = []
        for spec in args.variants.split(";"):
            name, _, assigns = spec.partition(":")
            env = dict(a.split("=", 1) for a in assigns.split(",") if a)
            variants.append((name.strip(), env))
        expanded = []
        for step in main_steps:
            if step in ("copy", "ceiling", "ceiling-hash") or plan[step][1] is None:
                expanded.append(step)
                continue
            for name, env in variants:
                key = f"{step} [{name}]"
                plan[key] = (f"{plan[step][0]} [{name}: {','.join(f'{k}={v}' for k, v in env.items()) or 'defaults'}]",
                             plan[step][1], env, step)
                expanded.append(key)
        main_steps = expanded
    if args.profile:
        os.environ["CKPTOOL_PROFILE"] = "1"
    global TRACE_DISK
    TRACE_DISK = args.disk_trace
    profiles = {} if args.profile else None
    if args.cache in ("warm", "cold") and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        ap.error(f"--cache {args.cache} drops the page cache: it needs root (/proc/sys/vm/drop_caches)")
    # one untimed start first (torch and the converters imported as the CLI would): the first ckptool process
    # on a host fills the bytecode cache (io/startup.py), ~4 s that would otherwise fall on
    # whichever step runs first
    warm = ("from ckptool.io import startup; startup.use_own_bytecode_cache(); "
            "import torch, ckptool.convert, ckptool.formats.megatron.checkpoint, ckptool.formats.hf.writer")
    subprocess.run([sys.executable, "-c", warm], capture_output=True, env=_env())
    rows = run_side_by_side(plan, main_steps, size, work, args.repeat, args.keep, profiles, args.cache, src)
    ds = deepspeed_rows(args, work) if "deepspeed" in steps else None
    if not args.keep and not args.reuse_src:
        shutil.rmtree(src, ignore_errors=True)

    load = os.getloadavg()
    print()
    print(f"Checkpoint: {style}, {size / 1e9:.2f} GB ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{grid}, bf16); largest layer {biggest_layer / 2**20:.0f} MiB (peak RSS bound 1 GiB + 2 x that = "
          f"{(2**30 + 2 * biggest_layer) / 2**20:.0f} MiB); {args.repeat} rounds; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end; page cache before each command: "
          f"{args.cache}")
    print()
    print_table(rows)
    if profiles:
        print_profiles(profiles, plan)
    if ds is not None:
        ds_size, ds_rows = ds
        print()
        if ds_size:
            print(f"DeepSpeed: real ZeRO-2 bf16 checkpoint of GPT-2 small (124M parameters, 2 data-parallel "
                  f"ranks, fp32 masters + Adam moments), {ds_size / 1e9:.2f} GB")
            print()
        print_table(ds_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
