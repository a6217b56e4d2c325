"""Train and resume a tiny megatron-core GPT with megatron-core's own optimizer, on CPU under torchrun (gloo).

The resume-equivalence proof for carried optimizer state (tests/test_resume.py): a run trains at one
tensor-parallel size, saves Megatron-LM's torch format (what megatron/training/checkpointing.py writes for
--ckpt-format torch: args, checkpoint_version, iteration, model, optimizer, opt_param_scheduler; no RNG
state here, as ckptool never carries it) and goes on training; ckptool reshards the saved checkpoint; a
second run loads it at another TP size the way Megatron-LM's load_checkpoint does (model strict,
optimizer.load_state_dict, scheduler.load_state_dict) and trains the same further batches.

  "train DIR --tp T --steps N --more M --out FILE [--dtype bf16|fp32] [--dp D] [--distributed-optimizer]"
        train N steps, save DIR (iteration N), train M more; FILE gets the losses of all N + M steps and
        DIR_continued/ holds the final state (saved the same way) for comparing weights. With
        --distributed-optimizer FILE also gets `live`: per TP rank, per parameter name, the full fp32
        master and Adam moments the live optimizer held at the save (gathered from its DP shards).
  "resume DIR --tp T --more M --out FILE [--weights-only] [--dp D] [--distributed-optimizer]"
  (both: [--ddp-bucket-size N]: Megatron-LM's --overlap-grad-reduce --ddp-bucket-size N, so the grad
        buffers, and distrib_optim.pt's layout, are cut into buckets of about N elements)
        load DIR at TP T (with its optimizer unless --weights-only: then Adam starts from zero moments, as
        --no-load-optim does), train M steps on the batches that followed; FILE gets the losses and
        DIR_resumed_tpT/ the final state.

Multi-token prediction (--arch llama_mtp, issue 30): the model carries megatron-core's MTP block
(--mtp-num-layers 1); its loss enters the backward through GPTModel's MTPLossAutoScaler, and FILE also gets
`mtp_losses`, the MTP loss of every step as megatron-core's MTPLossLoggingHelper recorded it.

Param groups beyond the default pair (tests/test_optimizer_groups.py): --decoupled-lr X gives the
embedding and output layer their own learning rate (OptimizerConfig.decoupled_lr / decoupled_min_lr,
megatron-core's own group override; the args saved say so, as Megatron-LM's do), --lr-mult Y adds
lr_mult Y to the no-weight-decay override (a config override megatron-core 0.16 takes: its own group).

Pipeline stages (--pp P): one micro-batch goes through the stages by point-to-point send/recv and its
gradients back, then megatron-core's finalize_model_grads syncs the DP grads and the tied embedding's
grads between the first and last stage (as Megatron-LM's schedule does); rank directories are then
mp_rank_TT_PPP.

Data parallelism (--dp D, world size = TP x PP x D): every step's batch of BATCH samples is split evenly
over the D ranks and megatron-core's DDP averages the gradients, so the maths is the DP 1 run's up to
reduction order; the loss printed is the average over the DP ranks. --distributed-optimizer runs
megatron-core's DistributedOptimizer (DistributedDataParallelConfig and OptimizerConfig
use_distributed_optimizer) and saves as Megatron-LM does for --ckpt-format torch: DP rank 0 of each
TP rank writes model_optim_rng.pt with optimizer.state_dict() (param groups, no tensors), and
optimizer.save_parameter_state() writes distrib_optim.pt beside it (gathered over DP); resume loads
them back with load_state_dict + load_parameter_state, as Megatron-LM's load_checkpoint does.

megatron-core's optimizer is written for CUDA tensors: the shims below let it run on a CPU-only torch
(device='cuda' -> cpu at tensor creation; Tensor.type() answers with the CUDA type name megatron-core's
checks compare against; gradient clipping off, as its clip asserts CUDA tensors). They change where
tensors live, not the maths.
"""
import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _cpu_shims():
    def fix(kw):
        if "cuda" in str(kw.get("device", "")):
            kw["device"] = "cpu"
        return kw

    for name in ("tensor", "empty", "zeros", "ones", "full", "zeros_like", "empty_like", "ones_like", "arange"):
        orig = getattr(torch, name)
        setattr(torch, name, lambda *a, _f=orig, **kw: _f(*a, **fix(kw)))
    orig_to = torch.Tensor.to

    def to(self, *a, **kw):
        a = tuple("cpu" if isinstance(x, (str, torch.device)) and "cuda" in str(x) else x for x in a)
        return orig_to(self, *a, **fix(kw))

    torch.Tensor.to = to
    orig_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **kw: (orig_type(self, *a, **kw) if a or kw
                                                else orig_type(self).replace("torch.", "torch.cuda.", 1))


def _gloo_reduce_scatter():
    """gloo has no reduce_scatter_tensor: the same reduction as an all_reduce of the whole bucket, each
    rank then keeping its own shard (what reduce-scatter returns; only the communication differs). The
    buckets' collectives run one by one rather than coalesced: gloo would defer the all_reduce to the
    end of the coalescing block, after the shard was taken."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    class Done:  # the handle --overlap-grad-reduce waits on: the reduction already happened
        def wait(self):
            pass
    pgb._coalescing_manager = lambda *a, **k: contextlib.nullcontext(Done())

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        whole = input.clone()
        dist.all_reduce(whole, op=op, group=group)
        rank = dist.get_rank(group)
        output.copy_(whole[rank * output.numel():(rank + 1) * output.numel()])
        return None

    pgb.dist_reduce_scatter_func = reduce_scatter


def _torch_adam_step_kept():
    """megatron-core 0.16 with torch's own Adam (no Apex/TE, as on this CPU) loads distrib_optim.pt by
    copying every key of the torch Adam state, torch's per-parameter 'step' included, which the file does
    not hold (load_state_dict has already set it from the param groups): keep that step. load_state_dict
    also gives every parameter the SAME step tensor, which torch's Adam then increments once per
    parameter in place: each parameter gets its own copy, as a fresh torch Adam has."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()
            tensors = dict(tensors, step=state["step"])
        return orig(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _groups_told_apart_by_lr_bounds():
    """megatron-core 0.16 gives the --decoupled-lr group only an override max_lr / min_lr, but matches a
    loaded state dict's groups to its own by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)
    alone: the decoupled and default groups collide and it cannot load its own checkpoint (the same
    error with or without ckptool). Later megatron-core adds the override keys to the match; so does
    this helper, as that fix does: in optimizer.py, and in distrib_optimizer.py, which imported the
    tuple by value (patching only the first left the distributed optimizer merging the two groups on
    load: a ~1e-3 drift at the second resumed step)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer as mcore_optimizer
    if "max_lr" not in mcore_optimizer.param_group_identifier_keys:
        mcore_optimizer.param_group_identifier_keys += ("max_lr", "min_lr")
    distrib_optimizer.param_group_identifier_keys = mcore_optimizer.param_group_identifier_keys


if not torch.cuda.is_available():
    _cpu_shims()

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_dist_helper as H  # noqa: E402  (its own CUDA shims for the model; build() and megatron_args())

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

LR, MIN_LR, WD = 1e-2, 1e-3, 0.01
GROUPS: dict = {}  # this job's --decoupled-lr / --lr-mult
BATCH = 2
MTP_LOSSES: list = []  # this job's MTP loss per step (models with --mtp-num-layers; train_step appends)


def batch(step: int):
    """This rank's share of one training step's data: the step's BATCH samples are the same in every
    run; DP rank r of D takes samples r, r + D, ..."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, H.VOCAB, (BATCH, H.SEQ + 1), generator=g)
    dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens = tokens[r::dp]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(arch, tp, dtype, distributed=False, pp=1, bucket_size=None):
    model, cfg = H.build(arch, tp, pp)
    model.train()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        cfg.bf16, cfg.params_dtype = True, torch.bfloat16
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size),
        model)
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9,
                             adam_beta2=0.95, clip_grad=0.0, bf16=dtype == "bf16",
                             use_distributed_optimizer=distributed, decoupled_lr=GROUPS.get("decoupled_lr"),
                             decoupled_min_lr=GROUPS.get("decoupled_lr") and MIN_LR / 2)
    overrides = get_standard_config_overrides(config)
    if GROUPS.get("lr_mult"):
        overrides = {k: dict(v, lr_mult=GROUPS["lr_mult"]) if v.get("wd_mult") == 0.0 else v for k, v in overrides.items()}
    opt = get_megatron_optimizer(config, [ddp], config_overrides=overrides)
    sched = OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=0,
                                    lr_decay_steps=100, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                                    wd_incr_steps=100, wd_incr_style="constant")
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return model, ddp, opt, sched, cfg


def train_step(ddp, opt, sched, step: int) -> float:
    """One step on this rank's share of the batch. With pipeline stages (one micro-batch): each stage
    receives its input hidden states from the one before, the last computes the loss, gradients travel
    back the same way; megatron-core's finalize_model_grads then syncs DP grads and the tied
    embedding's grads between the first and last stage, as Megatron-LM's schedule does."""
    tokens, labels = batch(step)
    pos = torch.arange(H.SEQ).unsqueeze(0).expand(tokens.shape[0], H.SEQ)
    mask = torch.triu(torch.ones(1, 1, H.SEQ, H.SEQ, dtype=torch.bool), diagonal=1)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = ddp.module
    ddp.zero_grad_buffer()
    opt.zero_grad()
    hidden = None
    if not first:
        hidden = torch.empty(H.SEQ, tokens.shape[0], model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_()
        model.set_input_tensor(hidden)
    out = ddp(tokens, pos, attention_mask=mask, labels=labels if last else None)
    if last:
        loss = out.float().mean()
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
        loss = torch.zeros(())
    if not first:
        dist.send(hidden.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())
    if first and last:
        ddp.finish_grad_sync()
    else:
        finalize_model_grads([ddp])
    ok, _, _ = opt.step()
    assert ok, "optimizer step skipped"
    sched.step(increment=1)
    if model.config.mtp_num_layers:
        MTP_LOSSES.append(_reduced(_mtp_loss(last)))
    return _reduced(loss.detach().float().clone())


def _reduced(loss: torch.Tensor) -> float:
    """loss averaged over the DP ranks, from the last pipeline stage (the others hold zero)."""
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())  # only the last stage's is non-zero
    return loss.item() / parallel_state.get_data_parallel_world_size()


def _mtp_loss(last: bool) -> torch.Tensor:
    """The step's MTP loss (the sum over MTP layers of each one's mean token loss, unscaled), as megatron-core's
    GPTModel recorded it for logging in MTPLossLoggingHelper's tracker during the forward (last stage); the
    tracker is then cleared, as Megatron-LM's training loop does after logging. Its gradient already went
    into the backward through MTPLossAutoScaler, scaled by mtp_loss_scaling_factor / mtp_num_layers and by
    MTPLossAutoScaler's main-loss scale, 1 here (one micro-batch and no loss scaling: what Megatron-LM's
    forward_step sets then)."""
    tracker = MTPLossLoggingHelper.tracker
    if not last:
        return torch.zeros(())
    value = tracker["values"].detach().float().sum().clone()
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return value


def _rank_dir() -> str:
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    return name


def save(root: Path, model, opt, sched, cfg, arch, tp, iteration, distributed=False, bucket_size=None):
    """This rank's model_optim_rng.pt as Megatron-LM writes it for --ckpt-format torch (from DP rank 0),
    and with the distributed optimizer its distrib_optim.pt (a collective over the DP ranks)."""
    args = H.megatron_args(arch, cfg, tp, parallel_state.get_pipeline_model_parallel_world_size())
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    args.world_size = dist.get_world_size()
    args.use_distributed_optimizer = distributed
    args.overlap_grad_reduce = bucket_size is not None  # without it megatron-core builds one bucket per buffer
    args.ddp_bucket_size = bucket_size
    args.accumulate_allreduce_grads_in_fp32 = False  # DistributedDataParallelConfig's default, as above
    args.ckpt_format = "torch"
    args.bf16 = cfg.bf16
    args.params_dtype = cfg.params_dtype
    args.iteration = iteration
    args.consumed_train_samples = iteration * BATCH
    args.decoupled_lr = GROUPS.get("decoupled_lr")
    args.decoupled_min_lr = GROUPS.get("decoupled_lr") and MIN_LR / 2
    d = root / f"iter_{iteration:07d}" / _rank_dir()
    d.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
             "opt_param_scheduler": sched.state_dict()}
    if parallel_state.get_data_parallel_rank() == 0:
        torch.save(state, d / "model_optim_rng.pt")
    if distributed:
        opt.save_parameter_state(str(d / "distrib_optim.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def load(root: Path, model, opt, sched, weights_only: bool, distributed=False) -> int:
    """As Megatron-LM's load_checkpoint for --ckpt-format torch with --no-load-rng (and --no-load-optim
    when weights_only)."""
    it = int((root / "latest_checkpointed_iteration.txt").read_text())
    d = root / f"iter_{it:07d}" / _rank_dir()
    state = torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    assert state["args"].tensor_model_parallel_size == parallel_state.get_tensor_model_parallel_world_size()
    model.load_state_dict(state["model"], strict=True)
    if not weights_only:
        opt.load_state_dict(state["optimizer"])
        if distributed:
            opt.load_parameter_state(str(d / "distrib_optim.pt"))
        sched.load_state_dict(state["opt_param_scheduler"])
    else:  # --no-load-optim: the scheduler still starts from the checkpoint's iteration
        sched.step(increment=state["iteration"])
    return state["iteration"]


def shard_pieces(opt, names: dict) -> dict:
    """{names[param]: (numel, shape, start, end, {"param", "exp_avg", "exp_avg_sq"})}: this DP rank's shard
    of each parameter's fp32 master and moments in a DistributedOptimizer, at the ranges megatron-core's
    own range maps give."""
    out = {}
    for gbuf_range_maps in opt.gbuf_ranges:
        for maps in gbuf_range_maps.values():
            for bucket_map in maps:
                for param, ranges in bucket_map["param_map"].items():
                    tensors = opt._get_main_param_and_optimizer_states(param)
                    r = ranges["param"]
                    out[names[param]] = (param.numel(), tuple(param.shape), r.start, r.end,
                                         {k: tensors[k].detach().float().clone() for k in
                                          ("param", "exp_avg", "exp_avg_sq")})
    return out


def live_state(model, opt) -> dict:
    """{(TP rank, PP rank): {parameter name: {"param", "exp_avg", "exp_avg_sq"}}}: the live distributed
    optimizer's fp32 master and moments of every parameter (decoder layers named by their global index),
    assembled from each DP rank's shard at the ranges megatron-core's own range maps give (independent
    of how ckptool recomputes the buffer layout)."""
    (opt,) = getattr(opt, "chained_optimizers", [opt])  # a dense model: one DistributedOptimizer
    mine = {}
    names = {}
    for n, p in model.named_parameters():
        parts = n.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        names[p] = ".".join(parts)
    mine.update(shard_pieces(opt, names))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ((parallel_state.get_tensor_model_parallel_rank(),
                                    parallel_state.get_pipeline_model_parallel_rank()), mine))
    out: dict = {}
    for rank, pieces in every:
        for name, (numel, shape, start, end, tensors) in pieces.items():
            full = out.setdefault(rank, {}).setdefault(
                name, {k: torch.full((numel,), float("nan")) for k in tensors})
            for k, v in tensors.items():
                full[k][start:end] = v
    for params in out.values():
        for name, full in params.items():
            assert not any(t.isnan().any() for t in full.values()), f"{name}: DP shards do not cover it"
    return out


def run_job(a):
    assert a.tp * a.pp * a.dp == dist.get_world_size(), "run each job under torchrun with --nproc-per-node TP x PP x DP"
    if a.distributed_optimizer and not torch.cuda.is_available():
        _gloo_reduce_scatter()
        _torch_adam_step_kept()
    GROUPS.clear()
    MTP_LOSSES.clear()
    GROUPS.update({k: v for k, v in (("decoupled_lr", a.decoupled_lr), ("lr_mult", a.lr_mult)) if v})
    if a.decoupled_lr:
        _groups_told_apart_by_lr_bounds()
    model, ddp, opt, sched, cfg = build(a.arch, a.tp, a.dtype, a.distributed_optimizer, a.pp, a.ddp_bucket_size)
    root = Path(a.dir)
    losses, result = [], {}
    if a.mode == "train":
        for step in range(a.steps):
            losses.append(train_step(ddp, opt, sched, step))
        save(root, model, opt, sched, cfg, a.arch, a.tp, a.steps, a.distributed_optimizer, a.ddp_bucket_size)
        if a.distributed_optimizer:
            result["live"] = live_state(model, opt)
        for step in range(a.steps, a.steps + a.more):
            losses.append(train_step(ddp, opt, sched, step))
        save(Path(f"{root}_continued"), model, opt, sched, cfg, a.arch, a.tp, a.steps + a.more,
             a.distributed_optimizer, a.ddp_bucket_size)
    else:
        start = load(root, model, opt, sched, a.weights_only, a.distributed_optimizer)
        for step in range(start, start + a.more):
            losses.append(train_step(ddp, opt, sched, step))
        tag = "weights_only" if a.weights_only else "resumed"
        save(Path(f"{root}_{tag}_tp{a.tp}"), model, opt, sched, cfg, a.arch, a.tp, start + a.more,
             a.distributed_optimizer, a.ddp_bucket_size)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "mtp_losses": list(MTP_LOSSES), **result}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=2)
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--decoupled-lr", type=float)
    ap.add_argument("--lr-mult", type=float)
    ap.add_argument("--ddp-bucket-size", type=int, default=None,
                    help="run with --overlap-grad-reduce and buckets of this many elements")
    ap.add_argument("--out", required=True)
    return ap


def main():
    H.run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
