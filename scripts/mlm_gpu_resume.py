"""Megatron-LM's own training loop resumes from ckptool's resharded training state (4 GPUs, issue 19).

    python3 scripts/mlm_gpu_resume.py --megatron PATH/TO/Megatron-LM --work /tmp/w --out RESULTS

Needs 4 GPUs (NCCL), a Megatron-LM checkout (run from source, unmodified; its dataset helper is built
here first) and ckptool importable from this repository. Every Megatron-LM run uses --transformer-impl
local with the fusions off, so neither Transformer Engine nor apex is needed, and goes through
scripts/mlm_torch_adam.py, without which Megatron-LM's distributed optimizer cannot resume on torch's
Adam (docs/megatron-lm-gpu.md has the figures of a run and what Megatron-LM needed).

What runs, in order (several Megatron-LM jobs share the 4 GPUs at once: one process per GPU each):
  train    Megatron-LM trains each source job 5 steps, saving at step 3: GPT-2 style and Llama style
           at TP2 PP2 with Adam (also in fp32: adamfp32) and with --use-distributed-optimizer, in
           torch and torch_dist format, the torch-format job twice; a Mixtral-like MoE at TP1 EP2.
           Steps 4 and 5 of these runs are the reference; the repeats (and the torch_dist run, whose
           training is the same job) measure run-to-run noise.
  convert  ckptool reshards each step-3 checkpoint with its optimizer to TP1 PP4, TP4 PP1 and TP2 PP1
           DP2 (MoE: TP1 EP4); weights-only reshards beside the Adam ones; the MoE model also to-hf.
  logits   Megatron-LM's own fp32 logits of the MoE step-3 checkpoint (scripts/mlm_logits.py) against
           transformers' logits of ckptool's to-hf output.
  resume   Megatron-LM loads each output at its layout (--no-load-rng; weights-only: --no-load-optim)
           and trains steps 4 and 5; controls resume the untouched step-3 checkpoints (torch format)
           at their own layout.
  verify   `torchrun -m ckptool verify` with NCCL on every resharded output (the MoE one against
           Megatron-LM's logits too).
Results: OUT/results.json (every job: command, exit status, wall seconds, losses by step),
OUT/summary.md (gaps to the reference, noise, logits and verify lines) and OUT/logs.tgz (every
job's output). A job not started before --budget-s has rc None.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
NPROC = 4
# NVLink multicast stays off (the device machines' rule); the rest is what Megatron-LM asks for
# without Transformer Engine (one CUDA connection) and eager jit fusions.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "2"}

# One job's settings; dropout off, so a resumed run sees exactly the reference's computation
# (no RNG state is carried: --no-load-rng).
COMMON = """--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128
 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4
 --lr-decay-style constant --lr-warmup-iters 0 --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9
 --adam-beta2 0.95 --init-method-std 0.02 --seed 1234 --mock-data --tokenizer-type NullTokenizer
 --vocab-size 1001 --make-vocab-size-divisible-by 128 --split 949,50,1 --eval-iters 0 --eval-interval 1000
 --log-interval 1 --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
 --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion --num-workers 0
 --distributed-backend nccl --hidden-dropout 0 --attention-dropout 0""".split()
LLAMA = """--normalization RMSNorm --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --group-query-attention --num-query-groups 4 --ffn-hidden-size 704""".split()
MODELS = {
    "gpt2": "--ffn-hidden-size 1024".split(),
    "llama": LLAMA,
    "mixtral": LLAMA + """--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 704
 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall""".split(),
}
SAVE_STEP, LAST_STEP = 3, 5
JOB_TIMEOUT_S = 240  # one job; a hung NCCL collective must not eat the call
# MoE trains at TP1: megatron-core's MoE layer wants sequence parallelism at TP > 1, which its torch
# norms (no Transformer Engine or apex here) refuse (docs/megatron-lm-gpu.md).
SOURCE_LAYOUT = {"dense": dict(tp=2, pp=2, ep=1), "moe": dict(tp=1, pp=1, ep=2)}
# Where each source goes: name -> (tp, pp, ep, dp); dp = 4 / (tp * pp) for the dense part.
TARGETS = {"dense": {"tp1pp4": (1, 4, 1, 1), "tp4pp1": (4, 1, 1, 1), "tp2pp1dp2": (2, 1, 1, 2)},
           "moe": {"tp1ep4": (1, 1, 4, 4)}}
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.]+E[+-]\d+)")


@dataclass
class Job:
    name: str
    argv: List[str]
    cwd: Path
    env: Dict[str, str]
    phase: str
    gpu: bool
    info: dict = field(default_factory=dict)
    rc: Optional[int] = None
    wall: Optional[float] = None
    losses: Dict[int, float] = field(default_factory=dict)
    log: Optional[Path] = None


class Driver:
    def __init__(self, mlm: Path, work: Path, out: Path, gpu_jobs: int, cpu_jobs: int, deadline: float,
                 verify_models: Optional[List[str]] = None):
        self.mlm, self.work, self.out = mlm, work, out
        self.gpu_jobs, self.cpu_jobs, self.deadline = gpu_jobs, cpu_jobs, deadline
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.jobs: List[Job] = []
        self.verify_models = verify_models or list(MODELS)
        base = {**os.environ, **ENV}
        pypath = base.get("PYTHONPATH", "")
        self.mlm_env = {**base, "PYTHONPATH": f"{mlm}:{pypath}".rstrip(":")}
        self.ckpt_env = {**base, "PYTHONPATH": f"{REPO / 'src'}:{pypath}".rstrip(":")}

    # ---- running -------------------------------------------------------------------------------
    def run(self, jobs: List[Job]) -> None:
        """Run jobs, GPU jobs at most gpu_jobs at a time, CPU jobs cpu_jobs; skip what the deadline
        leaves no time for (rc None, recorded as not run)."""
        pending = list(jobs)
        running: List[tuple] = []
        while pending or running:
            width = self.gpu_jobs if any(j.gpu for j in pending) else self.cpu_jobs
            while pending and len(running) < width and time.time() < self.deadline:
                job = pending.pop(0)
                job.log = self.logs / f"{job.name}.log"
                log = open(job.log, "w")
                log.write("$ " + " ".join(job.argv) + "\n")
                log.flush()
                proc = subprocess.Popen(job.argv, cwd=job.cwd, env=job.env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                running.append((job, proc, log, time.time()))
            if pending and time.time() >= self.deadline and not running:
                break
            time.sleep(0.5)
            for item in list(running):
                job, proc, log, t0 = item
                if proc.poll() is None and time.time() - t0 > JOB_TIMEOUT_S:
                    os.killpg(proc.pid, 9)
                if proc.poll() is not None:
                    log.close()
                    job.rc, job.wall = proc.returncode, round(time.time() - t0, 1)
                    job.losses = parse_losses(self.logs / f"{job.name}.log")
                    running.remove(item)
                    status = "ok" if job.rc == 0 else f"FAILED rc={job.rc}"
                    print(f"[{time.strftime('%H:%M:%S')}] {job.phase:8s} {job.name}: {status} in {job.wall} s "
                          f"{fmt_losses(job.losses)}", flush=True)
        self.jobs.extend(jobs)

    def megatron(self, name: str, phase: str, model: str, layout: dict, extra: List[str], info: dict,
                 script: str = "pretrain_gpt.py", env: Optional[dict] = None) -> Job:
        """A Megatron-LM run of `script` on the 4 GPUs at `layout`."""
        par = ["--tensor-model-parallel-size", str(layout["tp"]), "--pipeline-model-parallel-size",
               str(layout["pp"])]
        if layout.get("ep", 1) > 1:
            par += ["--expert-model-parallel-size", str(layout["ep"])]
        argv = torchrun(NPROC) + [str(REPO / "scripts" / "mlm_torch_adam.py"), script] + COMMON + \
            ["--train-iters", str(LAST_STEP)] + MODELS[model] + par + extra
        return Job(name, argv, self.mlm, {**self.mlm_env, **(env or {})}, phase, True, info)

    def ckptool(self, name: str, phase: str, args: List[str], info: dict, nproc: int = 0) -> Job:
        """A ckptool command: in one process, or under torchrun with nproc ranks (NCCL on the GPUs)."""
        argv = (torchrun(nproc) if nproc else [sys.executable]) + ["-m", "ckptool"] + args
        return Job(name, argv, REPO, self.ckpt_env, phase, bool(nproc), info)

    # ---- the phases ----------------------------------------------------------------------------
    def setup(self) -> None:
        """Build Megatron-LM's dataset helper once with its own Makefile (every run calls `make` at
        start-up; concurrent builds would race). Where that make cannot build it (no python3-config or
        Python headers), the same source is compiled directly, or a helper built elsewhere from the same
        helpers.cpp is taken (MLM_HELPERS_PREBUILT), and the runs then get a no-op `make` first on PATH
        so that their start-up does not try again; the log says which happened."""
        datasets = self.mlm / "megatron" / "core" / "datasets"
        importable = [sys.executable, "-c", "from megatron.core.datasets import helpers_cpp"]
        built = subprocess.run(["make", "-C", str(datasets)], capture_output=True, text=True, env=self.mlm_env)
        print("make:", built.returncode, built.stdout[-1500:], built.stderr[-1500:], flush=True)
        ok = subprocess.run(importable, cwd=self.mlm, env=self.mlm_env, capture_output=True).returncode == 0
        if not ok:
            suffix = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_config_var("
                                     "'EXT_SUFFIX'))"], capture_output=True, text=True).stdout.strip()
            incl = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True,
                                  env=self.mlm_env).stdout.split()
            direct = subprocess.run(["g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *incl,
                                     str(datasets / "helpers.cpp"), "-o", str(datasets / f"helpers_cpp{suffix}")],
                                    capture_output=True, text=True)
            print("g++ direct:", direct.returncode, direct.stderr[-1500:], flush=True)
            ok = subprocess.run(importable, cwd=self.mlm, env=self.mlm_env, capture_output=True).returncode == 0
            if not ok and os.environ.get("MLM_HELPERS_PREBUILT"):
                shutil.copy(os.environ["MLM_HELPERS_PREBUILT"], datasets / f"helpers_cpp{suffix}")
                print("dataset helper: the prebuilt one", flush=True)
                ok = subprocess.run(importable, cwd=self.mlm, env=self.mlm_env, capture_output=True).returncode == 0
            if ok:
                shim = self.work / "make-shim"
                shim.mkdir(exist_ok=True)
                (shim / "make").write_text("#!/bin/sh\nexit 0\n")
                (shim / "make").chmod(0o755)
                self.mlm_env["PATH"] = f"{shim}:{self.mlm_env.get('PATH', '')}"
                print("dataset helper built outside Megatron's make; runs get a no-op make", flush=True)
        if not ok:
            raise SystemExit(f"Megatron-LM's dataset helper could not be built (make -C {datasets})")
        probe = subprocess.run([sys.executable, "-c", "import megatron.core, torch; print('megatron-core',"
                                " megatron.core.__version__, 'torch', torch.__version__, 'gpus',"
                                " torch.cuda.device_count())"], capture_output=True, text=True, env=self.mlm_env,
                               cwd=self.mlm)
        print(probe.stdout, probe.stderr[-3000:], flush=True)
        if probe.returncode != 0:
            raise SystemExit("Megatron-LM does not import")

    def sources(self, families: List[str], repeats: bool, optims: List[str]) -> Dict[str, dict]:
        """Every source job: name -> its settings (copy b: the same job again, for the noise). `optims`
        picks the dense jobs; the MoE model always has its two (Adam in torch format, the
        distributed optimizer in torch_dist)."""
        found = {}
        runs = (("torch", "a"), ("torch", "b"), ("torch_dist", "a")) if repeats else (("torch", "a"), ("torch_dist", "a"))
        for model in [m for m in ("gpt2", "llama") if m in families]:
            for optim in [o for o in optims if o in OPTIMS]:
                for fmt, copy in (runs if optim != "adamfp32" else (("torch", "a"),)):
                    found[f"{model}-{optim}-{fmt}-{copy}"] = dict(model=model, optim=optim, fmt=fmt, copy=copy,
                                                                  kind="dense")
        if "mixtral" in families:
            for optim, fmt in (("adam", "torch"), ("distopt", "torch_dist")):
                found[f"mixtral-{optim}-{fmt}-a"] = dict(model="mixtral", optim=optim, fmt=fmt, copy="a", kind="moe")
        return found

    def train(self, sources: Dict[str, dict]) -> None:
        jobs = []
        for name, s in sources.items():
            extra = ["--save-interval", str(SAVE_STEP), "--save", str(self.work / "src" / name),
                     "--ckpt-format", s["fmt"]] + optim_flags(s["optim"])
            jobs.append(self.megatron(f"train-{name}", "train", s["model"], SOURCE_LAYOUT[s["kind"]], extra, s))
        self.run(jobs)

    def convert(self, sources: Dict[str, dict]) -> List[dict]:
        """ckptool's reshards (and the MoE to-hf); returns what each resume should load."""
        jobs, outputs = [], []
        for name, s in sources.items():
            if s["copy"] != "a" or not self.trained(name):
                continue
            src = self.work / "src" / name
            for target, (tp, pp, ep, dp) in TARGETS[s["kind"]].items():
                modes = ["optim"] + (["weights"] if s["fmt"] == "torch" and s["optim"] == "adam" else [])
                for mode in modes:
                    dst = self.work / "out" / f"{name}-{target}-{mode}"
                    args = ["reshard", str(src), str(dst), "--tp", str(tp), "--pp", str(pp),
                            "--iteration", str(SAVE_STEP)]
                    if ep > 1:
                        args += ["--ep", str(ep)]
                    if mode == "weights":
                        args += ["--no-optimizer"]
                    elif s["optim"] == "distopt" and s["fmt"] == "torch":
                        args += ["--distributed-optimizer", "--dp", str(dp)]
                    info = dict(s, source=name, target=target, mode=mode, dst=str(dst),
                                layout=dict(tp=tp, pp=pp, ep=ep), dp=dp)
                    jobs.append(self.ckptool(f"reshard-{name}-{target}-{mode}", "convert", args, info))
                    outputs.append(info)
            if s["kind"] == "moe" and s["fmt"] == "torch":
                hf = self.work / "hf" / name
                jobs.append(self.ckptool(f"to-hf-{name}", "convert",
                                         ["to-hf", str(src), str(hf), "--iteration", str(SAVE_STEP)],
                                         dict(s, source=name, dst=str(hf))))
        self.run(jobs)
        done = {j.info.get("dst") for j in jobs if j.rc == 0}
        return [o for o in outputs if o["dst"] in done]

    def resume(self, sources: Dict[str, dict], outputs: List[dict]) -> None:
        jobs = []
        for o in outputs:
            extra = ["--load", o["dst"], "--no-load-rng", "--ckpt-format", o["fmt"]]
            extra += optim_flags(o["optim"]) + (["--no-load-optim"] if o["mode"] == "weights" else [])
            jobs.append(self.megatron(f"resume-{o['source']}-{o['target']}-{o['mode']}", "resume", o["model"],
                                      o["layout"], extra, o))
        # Controls: the untouched step-3 checkpoint resumed at its own layout (torch format: the
        # torch_dist ones would show Megatron-LM reading its own files once more, nothing of ckptool).
        for name, s in sources.items():
            if s["copy"] == "a" and s["fmt"] == "torch" and self.trained(name):
                extra = ["--load", str(self.work / "src" / name), "--ckpt-step", str(SAVE_STEP), "--no-load-rng",
                         "--ckpt-format", s["fmt"]] + optim_flags(s["optim"])
                info = dict(s, source=name, target="same", mode="control")
                jobs.append(self.megatron(f"resume-{name}-same-control", "resume", s["model"],
                                          SOURCE_LAYOUT[s["kind"]], extra, info))
        self.run(jobs)

    def logits(self, sources: Dict[str, dict]) -> None:
        """Megatron-LM's fp32 logits of the MoE torch-format step-3 checkpoint, then transformers' of to-hf."""
        jobs = []
        for name, s in sources.items():
            if s["kind"] != "moe" or s["fmt"] != "torch" or not self.trained(name):
                continue
            out = self.work / f"logits-{name}.pt"
            extra = ["--load", str(self.work / "src" / name), "--ckpt-step", str(SAVE_STEP), "--no-load-optim",
                     "--no-load-rng", "--ckpt-format", "torch"]  # no --bf16: an fp32 model, the 16-bit weights upcast
            jobs.append(self.megatron(f"logits-{name}", "logits", s["model"], SOURCE_LAYOUT["moe"], extra,
                                      dict(s, source=name, logits=str(out)),
                                      script=str(REPO / "scripts" / "mlm_logits.py"),
                                      env={"MLM_LOGITS_OUT": str(out)}))
        self.run(jobs)
        for job in jobs:
            hf = self.work / "hf" / job.info["source"]
            if job.rc != 0 or not hf.exists():
                continue
            cmp_job = Job(f"hf-logits-{job.info['source']}", [sys.executable, "-c", HF_COMPARE, str(hf),
                                                                job.info["logits"]],
                          REPO, self.ckpt_env, "logits", False, job.info)
            self.run([cmp_job])

    def verify(self, outputs: List[dict]) -> None:
        jobs, seen = [], set()
        for o in outputs:
            key = (o["model"], o["fmt"], o["target"])
            if o["mode"] != "optim" or key in seen or o["model"] not in self.verify_models:
                continue
            seen.add(key)
            lay = o["layout"]
            nproc = lay["tp"] * lay["pp"] * lay["ep"]  # verify's rule, torch format and torch_dist alike
            args = ["verify", o["dst"]]
            logits = self.work / f"logits-{o['source']}.pt"  # Megatron-LM's own, where computed
            if o["kind"] == "moe" and logits.exists():
                args += ["--reference-logits", f"{logits}:logits_fp32"]
            jobs.append(self.ckptool(f"verify-{o['model']}-{o['fmt']}-{o['target']}", "verify", args, o, nproc))
        self.run(jobs)

    def trained(self, name: str) -> bool:
        return any(j.name == f"train-{name}" and j.rc == 0 for j in self.jobs)

    # ---- results -------------------------------------------------------------------------------
    def report(self, started: float) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rows = [dict(name=j.name, phase=j.phase, rc=j.rc, wall=j.wall, losses=j.losses, argv=" ".join(j.argv),
                     info={k: v for k, v in j.info.items() if isinstance(v, (str, int, float, dict))})
                for j in self.jobs]
        (self.out / "results.json").write_text(json.dumps(rows, indent=1))
        (self.out / "summary.md").write_text(summary(self.jobs, time.time() - started))
        with tarfile.open(self.out / "logs.tgz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
        print((self.out / "summary.md").read_text())


HF_COMPARE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
hf_dir, logits_file = sys.argv[1], sys.argv[2]
ref = torch.load(logits_file)
model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
with torch.no_grad():
    got = model(ref["tokens"]).logits
v = ref["true_vocab_size"]
want = ref["logits_fp32"][..., :v]
err = (got[..., :v] - want).abs().max().item()
print(f"class={type(model).__name__} vocab={got.shape[-1]} true_vocab={v} max_abs_error={err:.3e}"
      f" max_abs_logit={want.abs().max().item():.3f} top1_agreement="
      f"{(got[..., :v].argmax(-1) == want.argmax(-1)).float().mean().item():.4f}")
"""


# The optimizer settings a source job runs with: Adam (megatron's non-distributed optimizer), the
# distributed optimizer, and Adam in an fp32 run (no --bf16), whose layout arithmetic rounds 2^16 times
# finer: it tells a resumed run's layout noise from an error in the carried state.
OPTIMS = {"adam": [], "distopt": ["--use-distributed-optimizer"], "adamfp32": []}


def torchrun(nproc: int) -> List[str]:
    """The launch of nproc ranks on this host (torchrun binds its own rendezvous port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def optim_flags(optim: str) -> List[str]:
    """The optimizer's and the compute dtype's flags of a job."""
    return OPTIMS[optim] + ([] if optim == "adamfp32" else ["--bf16"])


def parse_losses(log: Path) -> Dict[int, float]:
    """Loss of each step from Megatron-LM's log lines. Megatron-LM logs a run's first iteration
    without resetting its loss accumulators, so the line of the next iteration prints the mean of
    both: that step's own loss is 2 x printed - first (to the 7 printed digits)."""
    printed = []
    for line in log.read_text(errors="replace").splitlines():
        m = LOSS.search(line)
        if m:
            printed.append((int(m.group(1)), float(m.group(2))))
    found = dict(printed)
    if len(printed) >= 2 and printed[1][0] == printed[0][0] + 1:
        found[printed[1][0]] = 2 * printed[1][1] - printed[0][1]
    return found


def fmt_losses(losses: Dict[int, float]) -> str:
    return " ".join(f"{k}:{v:.6f}" for k, v in sorted(losses.items()))


def summary(jobs: List[Job], seconds: float) -> str:
    """OUT/summary.md: the jobs that failed; per source job, each resume's losses and gaps beside the
    reference (its own steps 4 and 5); the noise between runs of the same training; the logits and
    verify lines."""
    by = {j.name: j for j in jobs}
    lines = [f"# Megatron-LM resumes from ckptool's reshards ({seconds:.0f} s)", ""]
    failed = [j for j in jobs if j.rc not in (0,)]
    lines += ["## Jobs not ok", ""] + [f"- {j.name}: rc {j.rc}" for j in failed] + [""]
    lines += ["## Losses at steps 4 and 5: gap to the reference (train run, copy a)", "",
              "| source | target | mode | loss 4 | loss 5 | gap 4 | gap 5 |", "|---|---|---|---|---|---|---|"]
    noise = []
    for j in jobs:
        if j.phase != "train" or j.info.get("copy") != "a":
            continue
        src = j.name[len("train-"):]
        ref = j.losses
        for other in (f"train-{src[:-2]}-b", f"train-{src.replace('-torch-a', '-torch_dist-a')}"):
            o = by.get(other)
            if o is not None and o is not j and o.rc == 0 and ref:
                gaps = [abs(o.losses.get(s, float("nan")) - ref.get(s, float("nan"))) for s in (4, 5)]
                noise.append(f"- {src} vs {other[len('train-'):]}: steps 4/5 differ by {gaps[0]:.2e} / {gaps[1]:.2e}")
        for r in jobs:
            if r.phase != "resume" or r.info.get("source") != src:
                continue
            l4, l5 = r.losses.get(4), r.losses.get(5)
            g = [abs(x - ref[s]) if x is not None and s in ref else None for x, s in ((l4, 4), (l5, 5))]
            lines.append(f"| {src} | {r.info.get('target')} | {r.info.get('mode')} | {fmt(l4)} | {fmt(l5)} | "
                         f"{fmtg(g[0])} | {fmtg(g[1])} |" + ("" if r.rc == 0 else f" rc {r.rc}"))
        lines.append(f"| {src} | (reference) | train | {fmt(ref.get(4))} | {fmt(ref.get(5))} | | |")
    lines += ["", "## Run-to-run noise (the same job twice; torch_dist: the same training, saved otherwise)", ""]
    lines += noise + ["", "## Logits and verify", ""]
    for j in jobs:
        if j.phase in ("logits", "verify"):
            text = j.log.read_text(errors="replace").splitlines() if j.log and j.log.exists() else []
            keys = ("max_abs_error", "result", "top1_agreement", "mean_kl", "wrote ")
            said = [ln.strip() for ln in text[1:] if ln.startswith(keys) or "max_abs_error=" in ln]  # [0]: the command
            lines.append(f"- {j.name}: rc {j.rc}, {j.wall} s: " + "; ".join(said[-6:]))
    return "\n".join(lines) + "\n"


def fmt(x):
    return "-" if x is None else f"{x:.6f}"


def fmtg(x):
    return "-" if x is None else f"{x:.1e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron", type=Path, required=True, help="Megatron-LM checkout (run from source)")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (checkpoints, logs)")
    ap.add_argument("--out", type=Path, required=True, help="where results.json, summary.md, logs.tgz go")
    ap.add_argument("--models", default="gpt2,llama,mixtral", help="comma list of gpt2, llama, mixtral")
    ap.add_argument("--gpu-jobs", type=int, default=8, help="Megatron-LM jobs sharing the 4 GPUs at once")
    ap.add_argument("--cpu-jobs", type=int, default=16, help="ckptool conversions at once")
    ap.add_argument("--budget-s", type=float, default=400, help="start no job after this many seconds")
    ap.add_argument("--phases", default="train,convert,resume,logits,verify")
    ap.add_argument("--no-repeats", action="store_true", help="train each source job once (no noise runs)")
    ap.add_argument("--optims", default="adam,distopt", help="dense jobs' optimizers: comma list of adam, distopt, adamfp32 (Adam in an fp32 run)")
    ap.add_argument("--verify-models", default="gpt2,llama,mixtral", help="models whose outputs verify runs")
    a = ap.parse_args()
    started = time.time()
    if a.work.exists():
        shutil.rmtree(a.work)
    drv = Driver(a.megatron.resolve(), a.work.resolve(), a.out, a.gpu_jobs, a.cpu_jobs, started + a.budget_s,
                 a.verify_models.split(","))
    phases = a.phases.split(",")
    try:
        drv.setup()
        sources = drv.sources(a.models.split(","), not a.no_repeats, a.optims.split(","))
        drv.train(sources)
        outputs = drv.convert(sources) if "convert" in phases else []
        if "logits" in phases:
            drv.logits(sources)
        if "resume" in phases:
            drv.resume(sources, outputs)
        if "verify" in phases:
            drv.verify(outputs)
    finally:
        drv.report(started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
