"""torch_dist checkpoints WITH optimizer state, written and loaded by the real megatron-core (CPU, gloo, torchrun).

Megatron-LM's checkpointing.py for --ckpt-format torch_dist saves one dist_checkpointing state dict:
  model               model.sharded_state_dict()
  optimizer           optimizer.sharded_state_dict(model_sd, metadata=content_metadata)
  opt_param_scheduler, args, checkpoint_version, iteration, content_metadata
content_metadata says which form the distributed optimizer uses: 'dp_reshardable' (the default),
'fully_reshardable' (--dist-ckpt-optim-fully-reshardable) or, before megatron-core 0.14,
'fully_sharded_model_space'. The non-distributed optimizer ignores it (always model space). On load,
Megatron-LM reads content_metadata back from the checkpoint and builds the same state dict at the
loading run's own layout (dist_checkpointing reshards), then load_state_dict on model, optimizer and
scheduler. This helper does exactly that with the training loop of tests/mcore_train_helper.py.

  "save DIR --tp T [--pp P] --form F --steps N --more M --out FILE [--live LIVE] [--dtype bf16|fp32]
        [--bucket-size B] [--grad-fp32] [--decoupled-lr X] [--lr-mult Y] [--bridge]"
        train N steps at TP T, PP P (DP = world / (T x P)), save DIR (iteration N) in form F, train M more.
        F: plain (non-distributed optimizer) | fully_reshardable | fully_sharded_model_space |
        dp_reshardable | dp_zero_gather_scatter (distributed optimizer). --bucket-size B: --overlap-grad-reduce with buckets of
        B elements (the grad buffer cut into several buckets on the first pipeline stage). --grad-fp32:
        grads reduced in fp32 (the buffers' dtype key becomes (bf16, fp32)). --decoupled-lr / --lr-mult:
        the param groups of mcore_train_helper.py (embedding + output at their own lr, lr_mult on the
        no-weight-decay group); resume and load need the same flags. --bridge: saved as Megatron-Bridge
        saves (no args in the common state; iter_XXXXXXX/run_config.yaml holds the config). --trainer nemo | verl:
        saved as NeMo 2 (DIR/weights/, model keys under module., the optimizer's entry a one-element list,
        DIR/context/model.yaml) or verl's Megatron backend (DIR/dist_ckpt/, DIR/huggingface/config.json) save.
        fully_sharded_model_space is what megatron-core up to 0.14 saved by default (0.15 with
        --dist-ckpt-save-pre-mcore-014); 0.16 builds its sharded state dict still (flattened_range
        ShardedTensors per parameter and DP rank) but no longer stores flattened tensors, so the helper
        stores them as megatron-core 0.15 did (save_nd_flattened below).
        --live LIVE: the live optimizer's values at the save,
        per slot, written as Megatron-LM torch-format weights (LIVE/<slot>/...: each slot's tensors under
        the model's own parameter names, TP shards per mp_rank file), so ckptool's proven weight reader
        maps them to canonical names for comparison.
  "save-vpp DIR --pp P --vpp V [--tp T] [--layers L] [--bucket-size B] --form F --steps N --live LIVE --out FILE"
        the same with virtual pipeline chunks (llama, L layers, default 4): V model chunks per stage, each with its
        own DDP grad buffer, one distributed optimizer over all. No forward/backward (the helper has
        no interleaved schedule): each step gives every parameter a seeded random gradient and runs
        the real optimizer step, so masters, moments and weights are what megatron-core computes
        from those gradients. Saved as Megatron-LM does with VPP (model0, model1, ...).
  "load DIR --tp T --pp P --form F --live LIVE --out FILE [--arch A --layers L]"
        load DIR at TP T, PP P as in resume and write the optimizer's values as --live does (no training).
  "resume DIR --tp T --form F --more M --out FILE [--weights-only]"
        load DIR at TP T as Megatron-LM's load_checkpoint does (optimizer too unless --weights-only;
        form F says which optimizer the loading run uses) and train M steps on the batches that follow.
  "moe-save DIR --tp T --ep E [--etp M] --form F --out FILE [--dtype bf16] [--moe-arch A]"
  "moe-resume DIR --tp T --ep E [--etp M] --form F --out FILE [--weights-only]"
        mcore_moe_helper.py's MoE model (experts in a second, expert-parallel optimizer at EP > 1) with its
        optimizer in torch_dist, and resumed from it at another EP (run_moe below).
FILE gets {"losses": [...], "params": {name: full fp32 tensor}} (params gathered at the end, TP 1 only).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_train_helper as T  # noqa: E402  (CPU shims, batches, train_step)

H = T.H
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402


def _keep_torch_step(orig):
    """CPU shim (no TE/Apex): DistributedOptimizer.load_state_dict gives every torch Adam state the step
    from the checkpoint's param groups, then its fully_reshardable loader copies each state key from the
    checkpoint tensors, where 'step' never is (KeyError). Keep the step it has just set."""
    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return orig(self, model_param, tensors)
    return set_states


if not torch.cuda.is_available():
    DistributedOptimizer._set_main_param_and_optimizer_states = _keep_torch_step(
        DistributedOptimizer._set_main_param_and_optimizer_states)

DISTRIBUTED_FORMS = ("fully_reshardable", "fully_sharded_model_space", "dp_reshardable", "dp_zero_gather_scatter")
ND_FLATTENED = "fully_sharded_model_space"


def _allow_flattened_range():
    """megatron-core 0.16 still builds fully_sharded_model_space state (ShardedTensors with a
    flattened_range: each DP rank's slice of a parameter's flattened TP shard) but its metadata check
    now rejects flattened_range; skip only that check, the others still run."""
    from dataclasses import replace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    orig = ShardedTensor.validate_metadata_integrity

    def validate(self):
        if self.flattened_range is None:
            return orig(self)
        return orig(replace(self, data=None, flattened_range=None))

    ShardedTensor.validate_metadata_integrity = validate


_allow_flattened_range()


def nd_flattened(sh, flat, offset_in_local: int):
    """The ShardedTensor megatron-core < 0.15 stored for a flattened_range piece (its
    strategies/torch.py "N-D flattened" case): a [X, Y, Z] tensor cut into local [x, y, z] chunks is
    stored as [X/x, Y/y, Z/z, x*y*z], the piece at its chunk's grid position and, along the last axis,
    at its offset in the flattened local chunk. Returns the ShardedTensor of that layout (a regular
    one, which megatron-core 0.16 saves) and the original global shape (kept in .metadata's mcore_data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    chunk = tuple(sh.global_offset[:sh.prepend_axis_num]) + tuple(
        off // size for off, size in zip(sh.global_offset[sh.prepend_axis_num:], sh.local_shape))
    grid = tuple(sh.axis_fragmentations)
    numel = int(torch.Size(sh.local_shape).numel())
    shape = grid + (numel,)
    data = flat.reshape((1,) * len(grid) + (flat.numel(),))
    return ShardedTensor(sh.key, data, data.dtype, tuple(data.shape), shape, chunk + (offset_in_local,),
                         None, replica_id=sh.replica_id), tuple(sh.global_shape)


def save_nd_flattened(opt, param_state):
    """Replace fully_sharded_model_space's flattened_range ShardedTensors (and SwiGLU factories, whose
    0.16 build no longer splits a flattened range) by their N-D flattened storage; returns
    {key: original global shape}. opt: a DistributedOptimizer (or a chain of one)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    inner = getattr(opt, "chained_optimizers", [opt])[0]
    assert len(getattr(opt, "chained_optimizers", [opt])) == 1, "a chain: call it per optimizer"
    params = [p for maps in inner.gbuf_ranges for per_dtype in maps.values() for m in per_dtype
              for p in m["param_map"]]  # the order sharded_param_state_fs_model_space numbers them in
    shapes = {}
    for idx, param in enumerate(params):
        for name, sh in list(param_state[idx].items()):
            if not hasattr(sh, "flattened_range"):
                continue
            rng = sh.flattened_range
            if isinstance(sh, ShardedTensorFactory):
                # the factory's own split of the whole local tensor gives the parts' metadata; each
                # part (gate, up: halves of the flattened local tensor) keeps its share of the range
                parts = sh.build_fn(sh.key, torch.empty(param.shape, dtype=sh.data.dtype), sh.replica_id, None)
                half = param.numel() // 2
                out = []
                for j, part in enumerate(parts):
                    lo, hi = max(rng.start, j * half), min(rng.stop, (j + 1) * half)
                    if hi > lo:
                        t, shapes[part.key] = nd_flattened(part, sh.data[lo - rng.start:hi - rng.start], lo - j * half)
                        out.append(t)
                param_state[idx][name] = out
            else:
                param_state[idx][name], shapes[sh.key] = nd_flattened(sh, sh.data, rng.start)
    return shapes


def as_pre_016_metadata(d: Path, shapes):
    """Rewrite .metadata as megatron-core < 0.16 wrote it: its MCoreMetadata (a DCP Metadata with
    mcore_data: the original global shape of every N-D flattened tensor); 0.16 keeps the class name
    only so old checkpoints unpickle."""
    import pickle
    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata
    md = pickle.loads((d / ".metadata").read_bytes())
    old = MCoreMetadata.__new__(MCoreMetadata)
    old.__dict__.update(vars(md), mcore_data={k: {"nd_reformulated_orig_global_shape": s} for k, s in shapes.items()})
    (d / ".metadata").write_bytes(pickle.dumps(old))
SLOT_OF = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def build(arch, tp, dtype, distributed, pp=1, bucket_size=None, grad_fp32=False):
    """mcore_train_helper.build, with the distributed optimizer when asked, PP, --overlap-grad-reduce
    buckets of bucket_size elements, and grads reduced in fp32 (grad_fp32: Megatron-LM's
    --accumulate-allreduce-grads-in-fp32, which it turns on for bf16 by default)."""
    import contextlib
    model, cfg = H.build(arch, tp, pp)
    model.train()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        cfg.bf16, cfg.params_dtype = True, torch.bfloat16
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size, grad_reduce_in_fp32=grad_fp32), model)
    config = OptimizerConfig(optimizer="adam", lr=T.LR, min_lr=T.MIN_LR, weight_decay=T.WD,
                             adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.0,
                             bf16=dtype == "bf16", use_distributed_optimizer=distributed,
                             decoupled_lr=T.GROUPS.get("decoupled_lr"),
                             decoupled_min_lr=T.GROUPS.get("decoupled_lr") and T.MIN_LR / 2)
    opt = get_megatron_optimizer(config, [ddp], config_overrides=group_overrides(config))
    sched = OptimizerParamScheduler(opt, init_lr=T.LR, max_lr=T.LR, min_lr=T.MIN_LR, lr_warmup_steps=0,
                                    lr_decay_steps=100, lr_decay_style="cosine", start_wd=T.WD, end_wd=T.WD,
                                    wd_incr_steps=100, wd_incr_style="constant")
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return model, ddp, opt, sched, cfg


def group_overrides(config):
    """megatron-core's standard group overrides (no weight decay for biases and norms; --decoupled-lr for
    the embedding and output layer), plus --lr-mult on the no-weight-decay override as
    mcore_train_helper.build does: --decoupled-lr and --lr-mult give the three groups of
    tests/test_optimizer_groups.py."""
    overrides = get_standard_config_overrides(config)
    if T.GROUPS.get("lr_mult"):
        overrides = {k: dict(v, lr_mult=T.GROUPS["lr_mult"]) if v.get("wd_mult") == 0.0 else v
                     for k, v in overrides.items()}
    return overrides


def groups_told_apart_by_lr_bounds():
    """mcore_train_helper's fix (megatron-core 0.16 matches a loaded checkpoint's groups to its own by
    keys that do not tell the --decoupled-lr group from the default one; later releases add max_lr /
    min_lr), in optimizer.py and distrib_optimizer.py alike."""
    T._groups_told_apart_by_lr_bounds()


def content_metadata(form):
    """What Megatron-LM's _build_sharded_state_dict_metadata passes (and stores) for this form."""
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if form in DISTRIBUTED_FORMS:
        md["distrib_optim_sharding_type"] = form
        if form == "fully_reshardable":
            md["distrib_optim_fully_reshardable_mem_efficient"] = False
    return md


def state_dict(model, opt, sched, metadata, loading):
    model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
    sd = {"model": model_sd}
    sd["optimizer"] = opt.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)
    sd["opt_param_scheduler"] = sched.state_dict()
    return sd


def write_bridge_run_config(d: Path, cfg, a, args) -> None:
    """--bridge: Megatron-Bridge's iter_XXXXXXX/run_config.yaml (training/checkpointing.py): the model provider from
    the model's own TransformerConfig and the ddp / optimizer / checkpoint sections with megatron-core's
    DistributedDataParallelConfig / OptimizerConfig field names, holding what this run used."""
    import mcore_sidecar_helper as S
    model = S.provider_fields(a.arch, cfg, a.tp)
    model.update(pipeline_model_parallel_size=a.pp, bf16=cfg.bf16)
    S.write_yaml(d / "run_config.yaml", {
        "_target_": "megatron.bridge.training.config.ConfigContainer", "model": model,
        "ddp": {"use_distributed_optimizer": args.use_distributed_optimizer, "overlap_grad_reduce": args.overlap_grad_reduce,
                "bucket_size": args.ddp_bucket_size, "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32},
        "optimizer": {"optimizer": "adam", "use_distributed_optimizer": args.use_distributed_optimizer,
                      "decoupled_lr": args.decoupled_lr, "decoupled_min_lr": args.decoupled_min_lr, "bf16": cfg.bf16},
        "checkpoint": {"ckpt_format": "torch_dist",
                       "dist_ckpt_optim_fully_reshardable": args.dist_ckpt_optim_fully_reshardable}})


def save(root: Path, model, opt, sched, cfg, a, iteration):
    metadata = content_metadata(a.form)
    sd = state_dict(model, opt, sched, metadata, loading=False)
    shapes = save_nd_flattened(opt, sd["optimizer"]["param_state"]) if a.form == ND_FLATTENED else {}
    args = H.megatron_args(a.arch, cfg, a.tp, a.pp)
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    args.overlap_grad_reduce = a.bucket_size is not None
    args.ddp_bucket_size = a.bucket_size
    args.accumulate_allreduce_grads_in_fp32 = a.grad_fp32
    if cfg.num_layers_in_first_pipeline_stage:
        args.decoder_first_pipeline_num_layers = cfg.num_layers_in_first_pipeline_stage
    args.bf16 = cfg.bf16
    args.params_dtype = cfg.params_dtype
    args.iteration = iteration
    args.consumed_train_samples = iteration * T.BATCH
    args.use_distributed_optimizer = a.form in DISTRIBUTED_FORMS
    args.dist_ckpt_optim_fully_reshardable = a.form == "fully_reshardable"
    args.decoupled_lr = T.GROUPS.get("decoupled_lr")
    args.decoupled_min_lr = T.GROUPS.get("decoupled_lr") and T.MIN_LR / 2
    sd.update(args=args, checkpoint_version=3.0, iteration=iteration, content_metadata=metadata)
    if a.bridge:
        del sd["args"]  # Megatron-Bridge stores no args: the config goes to run_config.yaml
    if a.trainer in TRAINER_SAVES:
        return save_as_trainer(root, model, opt, sched, cfg, a, iteration, metadata)
    d = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(d))
    if a.bridge and dist.get_rank() == 0:
        write_bridge_run_config(d, cfg, a, args)
    if shapes:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, shapes)
        if dist.get_rank() == 0:
            as_pre_016_metadata(d, {k: v for part in every for k, v in part.items()})
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


# --trainer nemo | verl: the state dict each trainer hands dist_checkpointing.save, no Megatron-LM args, its sidecar
# written by tests/mcore_sidecar_helper.py (the same files as its weights-only modes).
def _nemo_state(model, opt, sched, metadata, iteration) -> dict:
    """NeMo 2's MegatronStrategy.save_checkpoint (NVIDIA/NeMo 8cfedd7 nemo/lightning/pytorch/strategies/
    megatron_strategy.py; _strategy_lib.optimizer_sharded_state_dict): the model's sharded state dict under
    `module.` (MegatronParallel), the optimizer's as a ONE-ELEMENT LIST, Lightning's own entries beside them."""
    model_sd = model.sharded_state_dict(prefix="module.", metadata=metadata)
    return {"sharded_state_dict": model_sd,
            "optimizer": [opt.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)],
            "state_dict": {}, "optimizer_states": {}, "lr_schedulers": [sched.state_dict()], "global_step": iteration,
            "epoch": 0, "pytorch-lightning_version": "2.5.0", "content_metadata": metadata}


def _verl_state(model, opt, sched, metadata, iteration) -> dict:
    """verl's MegatronCheckpointManager.generate_state_dict (volcengine/verl b178a3c verl/utils/checkpoint/
    megatron_checkpoint_manager.py): {"model", "optimizer", "lr_scheduler"}; verl passes the optimizer no metadata,
    so megatron-core's default form of its version applies: here the test's form is passed (the reader takes the
    form from the common state either way)."""
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=False, metadata=metadata),
            "lr_scheduler": sched.state_dict()}


TRAINER_SAVES = {"nemo": ("weights", _nemo_state), "verl": ("dist_ckpt", _verl_state)}


def save_as_trainer(root: Path, model, opt, sched, cfg, a, iteration, metadata) -> None:
    import types
    import mcore_sidecar_helper as S
    sub, make = TRAINER_SAVES[a.trainer]
    if dist.get_rank() == 0:
        (root / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(make(model, opt, sched, metadata, iteration), str(root / sub))
    if dist.get_rank() == 0:
        S.write_sidecars(types.SimpleNamespace(mode=a.trainer, arch=a.arch, tp=a.tp), cfg, root)
    dist.barrier()


def load(root: Path, model, opt, sched, a) -> int:
    it = int((root / "latest_checkpointed_iteration.txt").read_text())
    d = str(root / f"iter_{it:07d}")
    metadata = dist_checkpointing.load_content_metadata(d) or content_metadata(a.form)
    if a.weights_only:
        model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
        loaded = dist_checkpointing.load({"model": model_sd}, d, strict="assume_ok_unexpected")
        common = dist_checkpointing.load_common_state_dict(d)
        model.load_state_dict(loaded["model"], strict=False)
        sched.step(increment=common["iteration"])  # --no-load-optim: the scheduler still starts there
        return common["iteration"]
    inner = getattr(opt, "chained_optimizers", [opt])[0]
    if a.form in DISTRIBUTED_FORMS and not inner.optimizer.state:
        # CPU shim: without TE/Apex, DistributedOptimizer.state_dict() reads the step from the torch
        # state, which a fresh optimizer does not have yet (with TE it takes it from the groups); its own
        # dummy-state init fills it, and the load then overwrites every value.
        inner._init_optimizer_states_with_dummy_values()
    sd = state_dict(model, opt, sched, metadata, loading=True)
    loaded = dist_checkpointing.load(sd, d, strict="assume_ok_unexpected")
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    opt.load_state_dict(loaded["optimizer"])
    if a.form in DISTRIBUTED_FORMS and not torch.cuda.is_available():
        # CPU shim: without TE/Apex, load_state_dict gives every parameter's torch Adam state the SAME
        # step tensor, which torch's Adam then increments once per parameter; unshare it.
        for st in inner.optimizer.state.values():
            st["step"] = st["step"].clone()
    sched.load_state_dict(loaded["opt_param_scheduler"])
    return loaded["iteration"]


def live_slots(model, opt, distributed):
    """{slot: {param name: this TP rank's full (DP-gathered) tensor}} of the optimizer as it runs."""
    out = {s: {} for s in SLOT_OF}
    mine = {}
    opt = getattr(opt, "chained_optimizers", [opt])[0]  # get_megatron_optimizer wraps one optimizer
    for name, p in model.named_parameters():
        if distributed:
            if p not in opt.model_param_gbuf_map:  # wholly in another DP rank's shard
                continue
            rng = opt._get_model_param_range_map(p)["param"]
            tensors = opt._get_main_param_and_optimizer_states(p)
            mine[name] = (rng.start, rng.end, p.shape, {s: tensors[k].detach().clone() for s, k in SLOT_OF.items()})
        else:
            main = getattr(p, "main_param", p)
            st = opt.optimizer.state[main]
            for s in SLOT_OF:
                out[s][name] = (main if s == "master" else st[s]).detach().clone()
    if not distributed:
        return out
    every = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(every, mine, group=parallel_state.get_data_parallel_group())
    for name, p in model.named_parameters():
        for s in SLOT_OF:
            flat = torch.zeros(p.numel(), dtype=torch.float32)
            seen = 0
            for part in every:
                if name in part:
                    start, end, _, ts = part[name]
                    flat[start:end] = ts[s]
                    seen += end - start
            assert seen == p.numel(), (name, seen, p.numel())
            out[s][name] = flat.view(p.shape)
    return out


def save_live(live_root: Path, live, cfg, a, iteration):
    """Each slot as a Megatron-LM torch-format checkpoint (weights only) of this TP rank."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    first_dp = parallel_state.get_data_parallel_rank() == 0
    for slot, tensors in live.items():
        root = live_root / slot
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        d = root / f"iter_{iteration:07d}" / (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if a.pp > 1 else ""))
        args = H.megatron_args(a.arch, cfg, a.tp, a.pp)
        args.ckpt_format = "torch"
        args.params_dtype = torch.float32
        if first_dp:
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": tensors},
                       d / "model_optim_rng.pt")
            if tp_rank == 0 and pp_rank == 0:
                (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def build_vpp(a):
    """V llama model chunks per stage (untied: with synthetic gradients a tied embedding and its head
    copy would drift apart), DDP per chunk as Megatron-LM's get_model does (buckets only in chunk 0),
    one optimizer over all chunks."""
    import contextlib
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                                             virtual_pipeline_model_parallel_size=a.vpp)
    torch.manual_seed(1234)
    arch = H.ARCHS["llama"]
    cfg = TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.bfloat16, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_model_parallel_size=a.pp,
                            virtual_pipeline_model_parallel_size=a.vpp, hidden_dropout=0.0, attention_dropout=0.0,
                            **dict(arch["cfg"], num_layers=a.layers or 4))
    chunks, ddps = [], []
    for v in range(a.vpp):
        m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=H.PADDED, max_sequence_length=H.SEQ, vp_stage=v,
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                     **arch["model"]).to(torch.bfloat16)
        chunks.append(m)
        ddps.append(DistributedDataParallel(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=a.bucket_size is not None,
            bucket_size=a.bucket_size), m, disable_bucketing=v > 0))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=T.LR, min_lr=T.MIN_LR, weight_decay=T.WD,
                                                 adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.0, bf16=True,
                                                 use_distributed_optimizer=True), ddps)
    sched = OptimizerParamScheduler(opt, init_lr=T.LR, max_lr=T.LR, min_lr=T.MIN_LR, lr_warmup_steps=0,
                                    lr_decay_steps=100, lr_decay_style="cosine", start_wd=T.WD, end_wd=T.WD,
                                    wd_incr_steps=100, wd_incr_style="constant")
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return chunks, ddps, opt, sched, cfg


def synthetic_step(chunks, ddps, opt, sched, step):
    """Seeded random gradients into every parameter's main_grad (the grad buffer), then the real step."""
    for ddp in ddps:
        ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(100 + step * 7919 + dist.get_rank())
    for m in chunks:
        for p in m.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.01)
    ok, _, _ = opt.step()
    assert ok, "optimizer step skipped"
    sched.step(increment=1)


def run_vpp(a):
    chunks, ddps, opt, sched, cfg = build_vpp(a)
    for step in range(a.steps):
        synthetic_step(chunks, ddps, opt, sched, step)
    metadata = content_metadata(a.form)
    model_sd = {}
    sd = {}
    for v, m in enumerate(chunks):
        sd[f"model{v}"] = m.sharded_state_dict(prefix="", metadata=metadata)
        model_sd.update(sd[f"model{v}"])
    sd["optimizer"] = opt.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
    sd["opt_param_scheduler"] = sched.state_dict()
    args = H.megatron_args("llama", cfg, a.tp, a.pp)
    args.bf16, args.params_dtype, args.iteration = True, torch.bfloat16, a.steps
    args.consumed_train_samples = a.steps * T.BATCH
    args.virtual_pipeline_model_parallel_size = a.vpp
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    args.use_distributed_optimizer = True
    args.overlap_grad_reduce, args.ddp_bucket_size = a.bucket_size is not None, a.bucket_size
    sd.update(args=args, checkpoint_version=3.0, iteration=a.steps, content_metadata=metadata)
    root = Path(a.dir)
    d = root / f"iter_{a.steps:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(d))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(a.steps))
    # the live values per slot, as torch-format weights with VPP chunks (model0, model1, ...)
    per_chunk = [live_slots(m, opt, True) for m in chunks]  # chunk-local layer names, as the torch format has
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for slot in SLOT_OF:
        slot_root = Path(a.live) / slot
        rank_dir = slot_root / f"iter_{a.steps:07d}" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        if parallel_state.get_data_parallel_rank() == 0:
            rank_dir.mkdir(parents=True, exist_ok=True)
            largs = H.megatron_args("llama", cfg, a.tp, a.pp)
            largs.ckpt_format, largs.params_dtype = "torch", torch.float32
            largs.virtual_pipeline_model_parallel_size = a.vpp
            state = {"args": largs, "checkpoint_version": 3.0, "iteration": a.steps}
            state.update({f"model{v}": live[slot] for v, live in enumerate(per_chunk)})
            torch.save(state, rank_dir / "model_optim_rng.pt")
            if tp_rank == 0 and pp_rank == 0:
                (slot_root / "latest_checkpointed_iteration.txt").write_text(str(a.steps))
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save({"losses": [], "params": {}}, a.out)
    parallel_state.destroy_model_parallel()


def moe_live(model, opt, ep: int, distributed: bool) -> dict:
    """{(TP rank, global name): {"param", "exp_avg", "exp_avg_sq"}} of every optimizer of the chain: the
    distributed one's from its DP shards (mcore_moe_helper.live_distributed), the non-distributed one's
    from its fp32 masters and torch state."""
    import itertools
    import mcore_moe_helper as M
    if distributed:
        return M.live_distributed(model, opt, ep)
    names = {p: M.global_name(n, ep) for n, p in model.named_parameters()}
    mine = {}
    for sub in opt.chained_optimizers:
        if hasattr(sub, "float16_groups"):  # mixed precision: the torch state is keyed by the fp32 master
            pairs = zip(itertools.chain(*sub.float16_groups), itertools.chain(*sub.fp32_from_float16_groups))
        else:
            pairs = ((p, p) for g in sub.optimizer.param_groups for p in g["params"])
        for p, main in pairs:
            st = sub.optimizer.state[main]
            mine[names[p]] = {"param": main.detach().float().clone(), "exp_avg": st["exp_avg"].clone(),
                              "exp_avg_sq": st["exp_avg_sq"].clone()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (parallel_state.get_tensor_model_parallel_rank(), mine))
    return {(t, name): v for t, part in every for name, v in part.items()}


def tp_gathered(model, live: dict) -> dict:
    """{global name: {slot: full tensor}} from moe_live's per-TP-rank values, the TP shards put together
    as mcore_moe_helper.full_params puts the weights (a GLU fc1 as [all gate; all up])."""
    import re
    any_expert = re.compile(r"local_experts\.\d+\.")
    axis = {}
    for n, p in model.named_parameters():
        tp_axis = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        axis[any_expert.sub("local_experts.*.", n)] = tp_axis
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name in sorted({n for _, n in live}):
        a = axis.get(any_expert.sub("local_experts.*.", name), -1) if tp == 1 else \
            axis[any_expert.sub("local_experts.*.", name)]  # (at PP > 1 a stage names its own parameters only)
        out[name] = {}
        held = [t for t in range(tp) if (t, name) in live]  # at expert TP 1 an expert sits on one TP rank, whole
        for slot in live[(held[0], name)]:
            parts = [live[(t, name)][slot] for t in held]
            if tp == 1 or a < 0:
                full = parts[0]
            elif name.endswith("linear_fc1.weight") and model.config.gated_linear_unit:
                halves = [x.chunk(2, dim=0) for x in parts]
                full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                full = torch.cat(parts, dim=a)
            out[name][slot] = full
    return out


def _stateless_optimizer_state_dict() -> None:
    """CPU shim: megatron-core 0.16 builds the expert optimizer on every rank, with empty groups on a
    pipeline stage without MoE layers; without TE/Apex its state_dict() reads the step from the torch
    state, which that optimizer never gets (an assertion). With TE/Apex the step comes from the groups
    and is None there; do the same for an optimizer without state."""
    if getattr(DistributedOptimizer.state_dict, "_stateless", False):
        return
    orig = DistributedOptimizer.state_dict

    def state_dict(self):
        if self.optimizer.state:
            return orig(self)
        inner = {k: v for k, v in self.optimizer.state_dict().items() if k != "state"}
        for group in inner["param_groups"]:
            del group["params"]
        out = {"optimizer": inner}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    state_dict._stateless = True
    DistributedOptimizer.state_dict = state_dict


def _pipeline_layer_names(M, cfg, pp: int) -> None:
    """The live values under global layer numbers: a pipeline stage's TransformerBlock numbers its layers
    from 0 (an even split)."""
    import re
    offset = parallel_state.get_pipeline_model_parallel_rank() * (cfg.num_layers // pp)
    local = M.global_name

    def global_name(name, ep):
        return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.",
                      local(name, ep))

    M.global_name = global_name


def run_moe(a):
    """moe-save: one Adam step of mcore_moe_helper's MoE model (megatron-core's ChainedOptimizer [dense,
    expert] at EP > 1), saved as torch_dist in form F with the optimizer (iteration 7), FILE.live the live
    values, FILE.losses the step's loss and the next two (seeds 6, 7; at PP > 1, which has no pipeline
    schedule here, the step takes seeded random gradients instead and no losses follow). moe-resume: a fresh model and
    optimizer at this TP x EP load DIR as Megatron-LM's load_checkpoint does for torch_dist (optimizer
    too unless --weights-only, then reload_model_params as with --no-load-optim) and take those two steps."""
    import mcore_moe_helper as M
    distributed = a.form in DISTRIBUTED_FORMS
    M.configure(a.moe_arch, a.dtype == "bf16", distributed)
    model, cfg = M.build(a.tp, a.ep, a.pp, a.etp)
    ddp, opt = M.make_optimizer(model, cfg)  # before loading, as Megatron-LM's setup_model_and_optimizer
    root = Path(a.dir)
    d = root / "iter_0000007"
    metadata = content_metadata(a.form)
    if a.mode == "moe-save":
        if a.pp > 1:  # no pipeline schedule here: seeded random gradients and the real step (as save-vpp)
            _pipeline_layer_names(M, cfg, a.pp)
            _stateless_optimizer_state_dict()
            synthetic_step([model], [ddp], opt, argparse.Namespace(step=lambda increment: None), 5)
            first = None
        else:
            first = M.adam_step(ddp, opt, 5)
        model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
        sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)}
        shapes = {}
        if a.form == ND_FLATTENED:  # stored as megatron-core 0.15 did (save below), each optimizer of the chain
            subs = opt.chained_optimizers
            states = [sd["optimizer"][n] for n in range(len(subs))] if len(subs) > 1 else [sd["optimizer"]]
            for sub, state in zip(subs, states):
                shapes.update(save_nd_flattened(sub, state["param_state"]))
        args = M.run_args(cfg, a.tp, a.ep, a.pp, a.etp)
        args.ckpt_format, args.iteration, args.bf16, args.params_dtype = "torch_dist", 7, cfg.bf16, cfg.params_dtype
        args.use_distributed_optimizer = distributed
        args.dist_ckpt_optim_fully_reshardable = a.form == "fully_reshardable"
        args.data_parallel_size = parallel_state.get_data_parallel_world_size()
        sd.update(args=args, checkpoint_version=3.0, iteration=7, content_metadata=metadata)
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(d))
        if shapes:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, shapes)
            if dist.get_rank() == 0:
                as_pre_016_metadata(d, {k: v for part in every for k, v in part.items()})
        live = tp_gathered(model, moe_live(model, opt, a.ep, distributed))
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text("7")
            torch.save({"live": live}, a.out + ".live")
        losses = {"first": first}
    else:
        metadata = dist_checkpointing.load_content_metadata(str(d)) or metadata
        model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
        sd = {"model": model_sd}
        if not a.weights_only:
            for inner in opt.chained_optimizers:
                if distributed and not inner.optimizer.state:  # the CPU shim of load() above
                    inner._init_optimizer_states_with_dummy_values()
            sd["optimizer"] = opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load(sd, str(d), strict="assume_ok_unexpected")
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
        if a.weights_only:
            opt.reload_model_params()
        else:
            opt.load_state_dict(loaded["optimizer"])
            if distributed and not torch.cuda.is_available():  # the CPU shim of load() above
                for inner in opt.chained_optimizers:
                    for st in inner.optimizer.state.values():
                        st["step"] = st["step"].clone()
        losses = {}
    model.train()
    losses["next"] = [M.adam_step(ddp, opt, 6), M.adam_step(ddp, opt, 7)] if a.pp == 1 else []
    if dist.get_rank() == 0:
        torch.save(losses, a.out + ".losses")
    dist.barrier()
    parallel_state.destroy_model_parallel()


def run_job(a):
    if a.mode in ("moe-save", "moe-resume"):
        return run_moe(a)
    if a.mode == "save-vpp":
        return run_vpp(a)
    if a.layers is not None:  # another layer count for this job only
        cfg = H.ARCHS[a.arch]["cfg"]
        default, cfg["num_layers"] = cfg["num_layers"], a.layers
        try:
            return run_job(argparse.Namespace(**dict(vars(a), layers=None)))
        finally:
            cfg["num_layers"] = default
    T.GROUPS.clear()
    T.GROUPS.update({k: v for k, v in (("decoupled_lr", a.decoupled_lr), ("lr_mult", a.lr_mult)) if v})
    if a.decoupled_lr:
        groups_told_apart_by_lr_bounds()
    distributed = a.form in DISTRIBUTED_FORMS
    model, ddp, opt, sched, cfg = build(a.arch, a.tp, a.dtype, distributed, a.pp, a.bucket_size, a.grad_fp32)
    root = Path(a.dir)
    losses = []
    if a.mode == "save":
        for step in range(a.steps):
            losses.append(T.train_step(ddp, opt, sched, step))
        save(root, model, opt, sched, cfg, a, a.steps)
        if a.live:
            save_live(Path(a.live), live_slots(model, opt, distributed), cfg, a, a.steps)
        start, count = a.steps, a.more
    elif a.mode == "load":  # load only (any TP/PP), then write what the optimizer holds
        it = load(root, model, opt, sched, a)
        save_live(Path(a.live), live_slots(model, opt, distributed), cfg, a, it)
        start, count = it, 0
    else:
        start, count = load(root, model, opt, sched, a), a.more
    for step in range(start, start + count):
        losses.append(T.train_step(ddp, opt, sched, step))
    params = H.global_params(model) if a.tp == 1 else None
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "params": {k: v.float() for k, v in (params or {}).items()}}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "save-vpp", "resume", "load", "moe-save", "moe-resume"])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--form", default="plain", choices=("plain",) + DISTRIBUTED_FORMS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=2)
    ap.add_argument("--bucket-size", type=int)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--grad-fp32", action="store_true")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--live")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--moe-arch", default="mixtral")
    ap.add_argument("--etp", type=int, help="moe-save / moe-resume: expert tensor-parallel size (default --tp)")
    ap.add_argument("--decoupled-lr", type=float)
    ap.add_argument("--lr-mult", type=float)
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--bridge", action="store_true", help="save: as Megatron-Bridge does (no args; run_config.yaml)")
    ap.add_argument("--trainer", choices=sorted(TRAINER_SAVES), help="save: as NeMo 2 / verl's Megatron backend do")
    ap.add_argument("--out", required=True)
    return ap


def main():
    T.H.run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
