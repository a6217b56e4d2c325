"""Real DeepSpeed runs for the ds-universal writer (tests/test_ds_universal.py), on CPU under torchrun.

  save: DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/ds_universal_cases.py save OUT CASE...
        trains each case 2 steps at DP 2 and saves OUT/CASE/ckpt; OUT/CASE/truth.pt holds, from the
        live engine, every trainable parameter's fp32 master and Adam moments
        (safe_get_full_fp32_param / safe_get_full_optimizer_state), each frozen parameter's value and the
        optimizer step.
  load: DS_ACCELERATOR=cpu torchrun --nproc-per-node N tests/ds_universal_cases.py load OUT CASE...
        builds a fresh engine (same model, stage and dtype) with checkpoint.load_universal, loads
        OUT/CASE/universal, compares the same values with truth.pt and runs one more training step on a
        batch every rank shares, as the saving run did after its save (truth.pt "next_step": the loss of
        that step and of the same batch after it); rank 0 writes OUT/CASE/load_dpN.json: {"mismatch":
        [...], "compared": n, "step": ..., "moved": bool, "next_step": [loss, after], "truth_next_step": ...}.
        CASE:STAGE loads into an engine of ZeRO stage STAGE instead (OUT/CASE/load_dpN_zSTAGE.json).
  train: DS_ACCELERATOR=cpu torchrun --nproc-per-node N tests/ds_universal_cases.py train OUT CASE...
        tests/ds_train_cases.py's cases (its run_case), for a launch that makes both kinds of saves.
A CASE is MODEL-STAGE-DTYPE (MODEL: ds_train_cases.MODELS; "plain" is a module of its own, saved
without a config.json) with STAGE 1, 2, 3 or 3s (ZeRO-3 with small optimizer sub-groups) and
DTYPE bf16, fp16, fp32 or bf16opt (bf16 with fp32 gradient accumulation,
which at stage 1 runs DeepSpeed's BF16_Optimizer), e.g. gpt2-3-bf16. All cases share one launch; so do
several groups `MODE OUT CASE...` joined by `then` (one start of torch, deepspeed and transformers).
"""
import json
import os
import sys

import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_train_cases import allow_cpu_fp16, build, run_case, skip_shm_build  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


def ds_config(stage, dtype, universal=False, subgroups=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if subgroups:  # ZeRO-3 optimizer sub-groups of ~20k elements: several flat groups per rank
        cfg["zero_optimization"]["sub_group_size"] = 20000
    if dtype in ("bf16", "bf16opt"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16opt":  # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def engine_for(case, universal=False, stage=None):
    model_name, saved_stage, dtype = case.split("-")
    stage = saved_stage if stage is None else stage
    model = build(model_name)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config(int(stage[0]), dtype, universal, stage == "3s"))
    return engine


def train(engine, steps, seed):
    g = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, 1001, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()


def snapshot(engine, moments=True):
    """name -> {fp32, exp_avg, exp_avg_sq} for trainable params (collectives under ZeRO-3)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone().cpu()}
            for key in MOMENTS if moments else ():
                out[name][key] = safe_get_full_optimizer_state(p, key).detach().clone().cpu()
    return out


def frozen_values(engine):
    """name -> the full value of each frozen parameter (gathered under ZeRO-3: a collective)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().clone().cpu()
    return out


def optimizer_step(engine):
    opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = [s["step"] for s in opt.state.values() if "step" in s]
    return float(steps[0]) if steps else None


def next_step(engine):
    """One training step on a batch every rank shares (so any DP size computes the same gradient):
    (the loss that step computed, the loss of the same batch after it)."""
    ids = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(11))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        after = engine(input_ids=ids, labels=ids).loss
    return float(loss), float(after)


def save_case(out_dir, case):
    engine = engine_for(case)
    train(engine, 2, seed=1)
    engine.save_checkpoint(os.path.join(out_dir, case, "ckpt"))
    truth, frozen = snapshot(engine), frozen_values(engine)
    step = optimizer_step(engine)
    losses = next_step(engine)  # the un-converted run's next step, for the resumed engines to match
    if torch.distributed.get_rank() == 0:
        torch.save({"params": truth, "frozen": frozen, "step": step, "next_step": losses},
                   os.path.join(out_dir, case, "truth.pt"))
        config = getattr(engine.module, "config", None)  # a model of its own (plain) has none
        if config is not None:
            config.save_pretrained(os.path.join(out_dir, case, "ckpt"))
    torch.distributed.barrier()


def load_case(out_dir, spec):
    case, _, stage = spec.partition(":")  # CASE:STAGE loads into an engine of another ZeRO stage
    engine = engine_for(case, universal=True, stage=stage or None)
    truth = torch.load(os.path.join(out_dir, case, "truth.pt"), weights_only=False)
    # control: a fresh engine (no moments yet) must not already hold the saved masters
    fresh = snapshot(engine, moments=False)
    equal_before = sum(torch.equal(fresh[n]["fp32"], s["fp32"]) for n, s in truth["params"].items())
    engine.load_checkpoint(os.path.join(out_dir, case, "universal"))
    got = snapshot(engine)
    mismatch = []
    for name, states in truth["params"].items():
        for key, want in states.items():
            have = got.get(name, {}).get(key)
            if have is None or have.shape != want.shape or have.dtype != want.dtype or not torch.equal(have, want):
                mismatch.append(f"{name}/{key}")
    step = optimizer_step(engine)
    before = {n: s["fp32"] for n, s in got.items()}
    losses = next_step(engine)
    after = snapshot(engine)
    moved = all(not torch.equal(before[n], after[n]["fp32"]) for n in before)
    finite = all(torch.isfinite(after[n]["fp32"]).all() for n in after)
    if torch.distributed.get_rank() == 0:
        ws = torch.distributed.get_world_size()
        with open(os.path.join(out_dir, case, f"load_dp{ws}{'_z' + stage if stage else ''}.json"), "w") as f:
            json.dump({"mismatch": mismatch, "compared": sum(len(s) for s in truth["params"].values()),
                       "equal_before_load": int(equal_before), "step": step, "truth_step": truth["step"], "moved": moved, "finite": bool(finite),
                       "global_steps": engine.global_steps, "next_step": losses,
                       "truth_next_step": truth["next_step"]}, f)
    torch.distributed.barrier()


def main():
    allow_cpu_fp16()
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    run = {"save": save_case, "load": load_case, "train": run_case}
    group: list = []
    for arg in sys.argv[1:] + ["then"]:
        if arg != "then":
            group.append(arg)
            continue
        mode, out_dir, *cases = group
        for case in cases:
            run[mode](out_dir, case)
        group = []
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
