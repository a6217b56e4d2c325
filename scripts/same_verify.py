"""Same numbers before and after a change to verify: run a set of `ckptool verify` checks with two source
trees and compare what they print, line by line (the forward's wall time and progress bars left out), and the tensors verify compared (target and reference
logits and hidden states, saved as compare() receives them), bit for bit.

    git worktree add /tmp/base 4fa851d
    OMP_NUM_THREADS=1 python scripts/same_verify.py --base /tmp/base/src [--this SRC] [--work DIR] [--keep-base]

The checks: one process and torchrun (gloo) at TP2 PP2 of fixtures/gpt2_mcore_tp2pp2 against its Hugging Face
ground truth (also in bf16, where the tolerance follows the noise floor), of the real Megatron-LM checkpoints
against the framework's logits, and of tiny transformers-built MoE (Qwen3-MoE, at EP2) and MLA (DeepSeek-V3:
YaRN, group routing, at TP2) models written by from-hf, each also with one planted wrong tensor so the probes
of a diverging MoE / MLA layer run (verify/experts.py, verify/mla_probe.py). The cases are built once, with
this tree, under --work. Exit status 1 when any printed report or compared tensor differs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
REAL = ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]


def _scale_first(path: Path, contains: str) -> None:
    """Multiply the first tensor of a rank file whose name holds `contains` by 1.5 (a planted error)."""
    import torch
    obj = torch.load(path, weights_only=False)
    key = next(k for k in sorted(obj["model"]) if contains in k and k.endswith("weight"))
    obj["model"][key] = obj["model"][key] * 1.5
    torch.save(obj, path)


def build(work: Path) -> dict:
    """{'single': {name: args}, 2: {name: args}, 4: {name: args}}: the verify arguments of every case."""
    from ckptool import api
    quiet = dict(warn=lambda m: None)
    for family in ("qwen3_moe", "deepseek_v3"):
        if not (work / family).exists():
            subprocess.run([sys.executable, ROOT / "scripts" / "make_hf_moe.py", work / family, "--family", family,
                            "--size", "tiny", "--dtype", "fp32"], check=True)
    if not (work / "moe_ep2").exists():
        api.from_hf(work / "qwen3_moe", work / "moe_ep2", ep=2, **quiet)
        shutil.copytree(work / "moe_ep2", work / "moe_ep2_bad")
        _scale_first(next((work / "moe_ep2_bad").glob("*/mp_rank_00_001/model_optim_rng.pt")), "layers.0.mlp.experts")
        api.from_hf(work / "deepseek_v3", work / "mla_tp2", tp=2, **quiet)
        shutil.copytree(work / "mla_tp2", work / "mla_tp2_bad")
        _scale_first(next((work / "mla_tp2_bad").glob("*/mp_rank_01/model_optim_rng.pt")),
                     "layers.0.self_attention.linear_kv_up_proj")
    gpt2 = [FIX / "gpt2_mcore_tp2pp2" / "checkpoint", "--reference", FIX / "gpt2_mcore_tp2pp2" / "hf"]
    real = {f"real_{c}": [FIX / "real" / c / "checkpoint", "--reference-logits",
                          f"{FIX / 'real' / c / 'reference_logits.pt'}:logits_fp32"] for c in REAL}
    moe = {"moe_ep2": [work / "moe_ep2", "--reference", work / "qwen3_moe"],
           "moe_ep2_bad": [work / "moe_ep2_bad", "--reference", work / "qwen3_moe"],
           "mla_tp2": [work / "mla_tp2", "--reference", work / "deepseek_v3"],
           "mla_tp2_bad": [work / "mla_tp2_bad", "--reference", work / "deepseek_v3"]}
    single = {"gpt2": gpt2, "gpt2_bf16": gpt2 + ["--dtype", "bf16"], "gpt2_self": gpt2[:1], **real, **moe}
    cases = {"single": single, 2: moe, 4: {"gpt2": gpt2, "gpt2_self": gpt2[:1], **real}}
    return {k: {name: [str(a) for a in args] for name, args in v.items()} for k, v in cases.items()}


def _dump_compared(out_dir: str):
    """Wrap verify's compare so that each call also saves what it compared (target and reference logits and
    hidden states) to OUT_DIR/NAME.pt, NAME set per case: the numbers behind the printed report, bit for bit."""
    import torch
    from ckptool.verify import compare as cmp
    plain, current = cmp.compare, {}

    def compare(logits, ref_logits, *args, **kw):
        hidden, ref_hidden = (args[2:4] if len(args) >= 4 else (kw.get("hidden"), kw.get("ref_hidden")))
        torch.save({"logits": logits, "ref_logits": ref_logits, "hidden": hidden, "ref_hidden": ref_hidden},
                   Path(out_dir, f"{current['name']}.pt"))
        return plain(logits, ref_logits, *args, **kw)
    cmp.compare = compare
    return current


def run_cases(cases_file: str, out_dir: str, torchrun: bool) -> None:
    """Each case as the real command (ckptool.cli) in this process, its output and exit status in
    OUT_DIR/NAME.txt (as tests/verify_batch.py does; under torchrun the ranks join one process group once)."""
    import torch.distributed as dist
    from ckptool import distributed
    sys.path.insert(0, str(ROOT / "tests"))
    from verify_batch import run_case  # the real command, its stdout and stderr, its exit status
    current = _dump_compared(out_dir)
    if torchrun:  # a failed case must not stop the other ranks: they go on to the next case at once
        distributed.REPORTER_GRACE_S = distributed.AGREED_GRACE_S = 0.0
        dist.init_process_group("gloo")
    for name, args in json.loads(Path(cases_file).read_text()).items():
        current["name"] = name
        text, rc = run_case(args)
        if not torchrun or dist.get_rank() == 0:
            Path(out_dir, f"{name}.txt").write_text(f"{text}rc={rc}\n")
    if torchrun:
        dist.destroy_process_group()


def run_all(src: Path, cases: dict, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    for kind, group in cases.items():
        where = out / str(kind)
        where.mkdir(parents=True, exist_ok=True)
        spec = out / f"{kind}.json"
        spec.write_text(json.dumps(group))
        if kind == "single":
            cmd = [sys.executable, __file__, "--run-cases", spec, where]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(kind),
                   "--master-port", str(29000 + os.getpid() % 1000), __file__, "--run-cases", spec, where, "torchrun"]
        subprocess.run([str(c) for c in cmd], env=env, check=True, cwd=ROOT, capture_output=True)


PROGRESS = re.compile(r"\d+%\|")  # a progress bar's line (transformers' "Loading weights"): its rate varies


def report(text: str) -> list:
    """The printed lines that must be the same: all but the forward's wall time and progress bars."""
    return [line for line in text.splitlines() if not line.startswith("forward_seconds=") and not PROGRESS.search(line)]


def same_tensors(a, b) -> bool:
    """a and b equal bit for bit (tensors, or dicts / lists / tuples of them, or None)."""
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() \
            and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def compare_case(runs: dict, kind, name: str) -> bool:
    """Print whether the case's report and compared tensors are the same in both runs; True when they are."""
    import torch
    before, after = (report((runs[n] / str(kind) / f"{name}.txt").read_text()) for n in ("base", "this"))
    dumps = [runs[n] / str(kind) / f"{name}.pt" for n in ("base", "this")]
    tensors = [torch.load(d, weights_only=False) if d.exists() else None for d in dumps]
    same_lines, same_numbers = before == after, same_tensors(*tensors)
    verdict = next((x for x in after if x.startswith("result=")), after[-1] if after else "?")
    print(f"{'same' if same_lines and same_numbers else 'DIFFERENT'}  {kind}/{name}: {len(after)} lines "
          f"({'same' if same_lines else 'different'}), compared tensors "
          f"{'bit-identical' if same_numbers else 'DIFFERENT'}{'' if tensors[1] is not None else ' (none)'}, {verdict}")
    if not same_lines:
        for x, y in zip(before + [""] * len(after), after + [""] * len(before)):
            if x != y:
                print(f"    base: {x}\n    this: {y}")
    return same_lines and same_numbers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="the src/ directory of the tree to compare with")
    ap.add_argument("--this", type=Path, default=ROOT / "src", help="the src/ directory of the changed tree")
    ap.add_argument("--work", type=Path, default=Path("/tmp/same_verify"))
    ap.add_argument("--keep-base", action="store_true", help="reuse the base's reports of an earlier run")
    ap.add_argument("--run-cases", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run_cases:
        run_cases(a.run_cases[0], a.run_cases[1], len(a.run_cases) > 2)
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    cases = build(a.work)
    runs = {"base": a.work / "out_base", "this": a.work / "out_this"}
    for name, out in runs.items():
        if name == "base" and a.keep_base and out.exists():
            continue
        shutil.rmtree(out, ignore_errors=True)
        run_all(a.base if name == "base" else a.this, cases, out)
    differ = sum(not compare_case(runs, kind, name) for kind, group in cases.items() for name in group)
    print(f"{differ} of {sum(len(g) for g in cases.values())} reports differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
