"""Helper run under `torchrun --nproc-per-node N` (gloo, CPU) with the real megatron-core package: a tiny
GPTModel with MoE layers (local spec: SequentialMLP experts `mlp.experts.local_experts.{j}`, router
`mlp.router.weight`, allgather token dispatcher), saved and loaded in Megatron-LM's torch format.

  "save DIR --tp T --ep E [--pp P] [--etp M] [--arch mixtral|qwen2moe] --out FILE"   build the model at TP x EP (x PP), write
        DIR/latest_checkpointed_iteration.txt and DIR/iter_0000007/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
        as Megatron-LM's save_checkpoint names them (the EP rank suffix only when EP > 1), one file
        per (TP, PP, EP) rank holding that rank's state dict: the dense part (the same on every EP rank)
        and its local experts under their LOCAL index j (global expert = ep_rank * E/EP + j).
  "train DIR --tp T --ep E [--dtype bf16] --out FILE"   as save, after one Adam step of megatron-core's
        own optimizer (fp32, or bf16 with fp32 masters; get_megatron_optimizer; the CPU shims of mcore_train_helper.py), with the optimizer's
        state_dict() in the file as Megatron-LM saves it (at EP > 1 a ChainedOptimizer's list: [dense,
        expert]); FILE also gets `exp_avg`: per global parameter name (experts by global index), the
        live optimizer's first moment at the save; and FILE.losses the loss of that step and of two
        more steps taken after the save (`next`: what a resumed run must reproduce; the second step's
        loss is the first that depends on the loaded optimizer state).
        --distributed-optimizer: megatron-core's DistributedOptimizer (at EP > 1 a chain of the dense one
        over the data-parallel group and the expert one over the expert-data-parallel group), saved as
        Megatron-LM does for --ckpt-format torch: its groups in the rank file, and
        optimizer.save_parameter_state() writing distrib_optim.pt beside it (at EP > 1 a list [dense,
        expert], each part from that optimizer's DP rank 0, None elsewhere); FILE.moments then gets
        `live`: per (TP rank, global name) the live fp32 master and moments, from the DP shards (a legacy
        GroupedMLP weight, all local experts of an fc in one tensor, as `NAME@epR` per EP rank R).
  "resume DIR --tp T --ep E --out FILE [--weights-only]"   a fresh model and optimizer at TP x EP load
        DIR as Megatron-LM's load_checkpoint does (model strict, optimizer.load_state_dict; with
        --weights-only a fresh optimizer, as --no-load-optim) and take those two steps; FILE.losses
        gets their losses as `next`.
  "load-torch DIR --tp T --ep E [--pp P] --out FILE"   this rank's file into a fresh model with
        load_state_dict(strict=True), after comparing the parallel sizes in the file's args.
  "save-dist DIR --tp T --ep E [--pp P] [--singleton] --out FILE"   dist_checkpointing.save of GPTModel.sharded_state_dict()
        with the common state of a Megatron-LM run (args, checkpoint_version, iteration) into DIR/iter_0000007/
        (torch_dist: experts stacked under their global index), plus the tracker file; FILE also gets
        `params`: every parameter under its global name (experts by global index, TP shards gathered).
        --singleton: with the sharded_state_dict metadata singleton_local_shards (one key per expert, GLU
        fc1 as separate gate / up keys), as Megatron-LM 0.14-era runs could save.
  "load-dist DIR --tp T --ep E [--pp P] --out FILE"   dist_checkpointing.load of DIR at this layout into a fresh
        model, then load_state_dict(strict=True) (every parameter found, nothing left over).

--arch biased: the Mixtral-like model with sigmoid routing and an expert bias (--moe-router-enable-expert-bias), a
module buffer each training step moves by its own rule (Megatron-LM's finalize_model_grads; rate 0.1).
--arch grouped: the Mixtral-like model with megatron-core's legacy GroupedMLP experts (weight1 / weight2; the
CUDA-only grouped_gemm kernel stood in for by its maths on CPU).
Every mode writes the logits for TOKENS (megatron-core's own forward at that layout, gathered over TP) to FILE.
World size = TP x PP x DP; the experts' grid is expert TP (--etp, default TP) x EP x expert DP over the same
ranks, as megatron-core's parallel_state lays it out.
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the dense helper's CPU shims, tokens and pipeline/TP-gathering forward serve MoE models unchanged
from mcore_dist_helper import PADDED, SEQ, TOKENS, VOCAB, logits, rank_name, run_jobs  # noqa: E402

# megatron-core 0.16's router linear tests `te_general_gemm is not None`, but without Transformer Engine the
# name is never bound (its import fails before the fallback); None is what it means: a plain matmul.
from megatron.core.transformer.moe import moe_utils  # noqa: E402
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

EXPERTS, TOPK, MOE_FFN = 4, 2, 24

# Mixtral-like: RMSNorm, SwiGLU, rope, GQA, no biases, untied, every layer MoE
CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
           normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
           add_bias_linear=False, bias_activation_fusion=False, num_moe_experts=EXPERTS,
           moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN, moe_token_dispatcher_type="allgather",
           moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


# Qwen2-MoE-like: layer 0 dense (--moe-layer-freq [0, 1]), a shared expert with its sigmoid gate, QKV bias,
# softmax over all experts before the top-k and no renormalisation (--moe-router-pre-softmax)
ARCHS = {"mixtral": {}, "qwen2moe": dict(moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=16,
                                         moe_shared_expert_gate=True, moe_router_pre_softmax=True, add_qkv_bias=True)}
ARCH = {"name": "mixtral"}
DTYPE = {"bf16": False}  # train / resume --dtype
DISTRIBUTED = {"on": False}  # train / resume --distributed-optimizer
# Mixtral-like with megatron-core's legacy GroupedMLP experts (--moe-grouped-gemm without Transformer Engine:
# weight1 [h, local experts x fc1 rows], weight2 [local experts x ffn, h], run as one grouped GEMM)
ARCHS["grouped"] = dict(moe_grouped_gemm=True)
# Mixtral-like with sigmoid scores and an expert bias (a float32 buffer, set off zero here) steering the choice;
# each training step moves it by +-0.1 from the tokens each expert got (a rate high enough to change the routing)
ARCHS["biased"] = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=0.1)


def _cpu_grouped_gemm():
    """The grouped_gemm package (CUDA only) stood in for by its maths: rows of `a` in consecutive blocks of
    batch_sizes[i] tokens, each times b[i] (or its transpose)."""
    from types import SimpleNamespace
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(a, b, batch_sizes, trans_b=False):
        blocks = torch.split(a, [int(n) for n in batch_sizes])
        return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(blocks, b)])
    gg.grouped_gemm = SimpleNamespace(ops=SimpleNamespace(gmm=gmm))
    gg.ops = gg.grouped_gemm.ops


def build(tp, ep, pp=1, etp=None):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    torch.manual_seed(1234)  # the same on every rank: replicated params (norms, router) must agree
    cfg = TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
                            tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=etp or tp,
                            hidden_dropout=0.0, attention_dropout=0.0, **dict(CFG, **ARCHS[ARCH["name"]]))
    if ARCH["name"] in ("mixtral", "grouped", "biased"):
        grouped = ARCH["name"] == "grouped"
        if grouped:
            _cpu_grouped_gemm()
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped, normalization="RMSNorm",
                                        moe_use_legacy_grouped_gemm=grouped)
    else:  # dense and MoE layers: one spec per layer
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=PADDED, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    with torch.no_grad():  # norms off 1, and each expert's weights distinct per global expert
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if ".router." in name:
                p.mul_(20.0)  # decisive routing: ties between experts would make the test meaningless
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for name, p in model.named_parameters():
            if ".local_experts." in name:  # experts on other EP ranks were initialised from the same seed
                j = int(name.split(".local_experts.")[1].split(".")[0])
                p.add_(0.05 * (ep_rank * (EXPERTS // ep) + j + 1))
            if name.endswith((".experts.weight1", ".experts.weight2")):  # GroupedMLP: all local experts at once
                p.add_(0.05 * (ep_rank + 1))
        for name, b in model.named_buffers():
            if name.endswith("router.expert_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    if ARCH["name"] == "grouped":  # GroupedMLP asserts bf16 for its CUDA kernel; the CPU stand-in is exact in fp32
        from megatron.core.transformer.moe.experts import GroupedMLP
        for m in model.modules():
            if isinstance(m, GroupedMLP):
                m.config = copy.copy(m.config)
                m.config.bf16 = True
    model.eval()
    return model, cfg


def run_args(cfg, tp, ep, pp, etp=None):
    args = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels, group_query_attention=True,
        num_query_groups=cfg.num_query_groups, max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=cfg.layernorm_epsilon,
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        vocab_size=VOCAB, padded_vocab_size=PADDED, make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp, ckpt_format="torch", use_legacy_models=False, transformer_impl="local",
        tokenizer_type="NullTokenizer",
        # the NullTokenizer of Megatron-LM c9dfe34 (2026-04) on: vocab_size tokens, no EOD beyond them
        null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1, bias_gelu_fusion=False, openai_gelu=False, rotary_base=10000,
        rotary_percent=1.0, num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
        moe_layer_freq=1, moe_router_pre_softmax=False, moe_router_score_function="softmax",
        moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None,
        moe_grouped_gemm=False, moe_router_enable_expert_bias=False, moe_token_dispatcher_type="allgather")
    for k, v in ARCHS[ARCH["name"]].items():
        setattr(args, k, v)
    return args


def rank_dir(root: Path, pp: int, ep: int) -> Path:
    return root / "iter_0000007" / rank_name(pp, ep)


def writes_file() -> bool:
    """Megatron-LM's torch format: one file per (TP, PP, EP) rank name, from data-parallel rank 0 and
    expert-data-parallel rank 0 (checkpointing.py save_checkpoint; with expert TP below TP only some
    (TP, EP) names are written, each holding its ranks' dense shard and their expert-TP shard)."""
    return parallel_state.get_data_parallel_rank() == 0 or parallel_state.get_expert_data_parallel_rank() == 0


def global_name(name: str, ep: int) -> str:
    """A parameter's name with its local expert index made global (what ckptool's names count)."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    j, tail = rest.split(".", 1)
    return f"{head}.local_experts.{parallel_state.get_expert_model_parallel_rank() * (EXPERTS // ep) + int(j)}.{tail}"


def stacked_name(name: str) -> str:
    """A legacy GroupedMLP weight (all local experts in one tensor) named apart per EP rank: `NAME@epR`."""
    if name.endswith((".experts.weight1", ".experts.weight2")):
        return f"{name}@ep{parallel_state.get_expert_model_parallel_rank()}"
    return name


def make_optimizer(model, cfg):
    """megatron-core's DDP and optimizer (get_megatron_optimizer: a ChainedOptimizer of the dense and, at
    EP > 1, the expert-parallel optimizer), as Megatron-LM's setup_model_and_optimizer builds them."""
    import contextlib
    import mcore_train_helper  # noqa: F401  (its CPU shims for megatron-core's optimizer)
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    model.train()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        train_without_sequence_parallel()
    if DTYPE["bf16"]:  # mixed precision: bf16 weights, fp32 masters in each optimizer of the chain
        model.to(torch.bfloat16)
        cfg.bf16, cfg.params_dtype = True, torch.bfloat16
    distributed = DISTRIBUTED["on"]
    if distributed and not torch.cuda.is_available():
        mcore_train_helper._gloo_reduce_scatter()
        mcore_train_helper._torch_adam_step_kept()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                                 bf16=DTYPE["bf16"], use_distributed_optimizer=distributed), [ddp])
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return ddp, opt


def adam_step(ddp, opt, seed: int) -> float:
    """One training step on the batch of this seed (the same on every rank); returns its loss."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens[:, :-1], pos, attention_mask=mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    if ddp.config.moe_router_enable_expert_bias:  # the expert bias's own update (Megatron-LM's finalize_model_grads)
        import importlib  # the module, not the function megatron.core.distributed re-exports under its name
        fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        fmg._update_router_expert_bias([ddp], ddp.config)
        fmg.reset_model_temporary_tensors(ddp.config, [ddp])
    assert opt.step()[0], "optimizer step skipped"
    return loss.item()


def train_without_sequence_parallel():
    """megatron-core refuses to train MoE at TP > 1 without sequence parallelism, for speed only (the
    maths is the same; its eval-mode forward at TP 2 gives the TP 1 logits), and sequence parallelism
    needs a reduce-scatter gloo lacks: the MoE layer's check is passed by running its forward with the
    training flag off (nothing else in these MoE layers reads it: no dropout, jitter or aux loss)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    if getattr(MoELayer.forward, "_no_sp_check", False):
        return
    forward = MoELayer.forward

    def unchecked(self, *args, **kwargs):
        was, self.training = self.training, False
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.training = was

    unchecked._no_sp_check = True
    MoELayer.forward = unchecked


def train_one_step(model, cfg):
    """One Adam step with megatron-core's optimizer; returns DDP, the optimizer, the loss and
    {global name: live exp_avg}."""
    ddp, opt = make_optimizer(model, cfg)
    loss = adam_step(ddp, opt, 5)
    model.eval()
    live = {}
    for sub in opt.chained_optimizers:
        # mixed precision: the torch state is keyed by each model parameter's fp32 master
        main_of = {id(m): p for mg, fg in zip(getattr(sub, "fp32_from_float16_groups", []),
                                               getattr(sub, "float16_groups", [])) for m, p in zip(mg, fg)}
        for p, st in sub.optimizer.state.items():
            live[id(main_of.get(id(p), p))] = st["exp_avg"].detach().clone()
    moments = {global_name(n, parallel_state.get_expert_model_parallel_world_size()): live[id(p)]
               for n, p in model.named_parameters() if id(p) in live}
    return ddp, opt, loss, moments


def live_distributed(model, opt, ep) -> dict:
    """{(TP rank, global name): {"param", "exp_avg", "exp_avg_sq"}}: every DistributedOptimizer's fp32
    master and moments of each parameter, put together from each DP rank's shard at the ranges
    megatron-core's own range maps give (independent of ckptool's buffer layout)."""
    from mcore_train_helper import shard_pieces  # (imported by training already: its CPU shims)
    names = {p: stacked_name(global_name(n, ep)) for n, p in model.named_parameters()}
    mine = {}
    for sub in opt.chained_optimizers:
        mine.update(shard_pieces(sub, names))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (parallel_state.get_tensor_model_parallel_rank(), mine))
    out: dict = {}
    shapes = {}
    for t, pieces in every:
        for name, (numel, shape, start, end, tensors) in pieces.items():
            full = out.setdefault((t, name), {k: torch.full((numel,), float("nan")) for k in tensors})
            shapes[(t, name)] = shape
            for k, v in tensors.items():
                full[k][start:end] = v
    for key, full in out.items():
        assert not any(v.isnan().any() for v in full.values()), f"{key}: the DP shards do not cover it"
    return {key: {k: v.reshape(shapes[key]) for k, v in full.items()} for key, full in out.items()}


def configure(arch: str, bf16: bool = False, distributed: bool = False) -> None:
    """Set the model and optimizer every later build() / make_optimizer() of this process makes: each job (of this
    helper or another calling it, tests/mcore_jobs.py runs many in one process) sets all three first."""
    ARCH["name"], DTYPE["bf16"], DISTRIBUTED["on"] = arch, bf16, distributed


def run_job(a):
    configure(a.arch, a.dtype == "bf16", a.distributed_optimizer)
    model, cfg = build(a.tp, a.ep, a.pp, a.etp)
    root = Path(a.dir)
    d = rank_dir(root, a.pp, a.ep)
    losses = None
    if a.mode in ("save-dist", "load-dist"):
        dist_job(a, model, cfg, root)
        return
    if a.mode in ("save", "train"):
        ddp, opt, loss, moments = train_one_step(model, cfg) if a.mode == "train" else (None, None, None, None)
        if writes_file():
            d.mkdir(parents=True, exist_ok=True)
            state = {"args": run_args(cfg, a.tp, a.ep, a.pp, a.etp), "checkpoint_version": 3.0, "iteration": 7,
                     "model": model.state_dict_for_save_checkpoint()}
            if opt is not None:
                state["optimizer"] = opt.state_dict()
            if a.distributed_optimizer:
                state["args"].use_distributed_optimizer = True
                state["args"].data_parallel_size = parallel_state.get_data_parallel_world_size()
                state["args"].overlap_grad_reduce = False
                state["args"].accumulate_allreduce_grads_in_fp32 = False  # DistributedDataParallelConfig's default
                state["args"].bf16 = DTYPE["bf16"]
            torch.save(state, d / "model_optim_rng.pt")
        if a.distributed_optimizer and opt is not None:  # a collective: every rank, the DP-rank-0 ones write
            dist.barrier()
            opt.save_parameter_state(str(d / "distrib_optim.pt"))
            live = live_distributed(model, opt, a.ep)
            if dist.get_rank() == 0:
                torch.save({"live": live}, a.out + ".live")
        if moments is not None:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (parallel_state.get_tensor_model_parallel_rank(), moments))
            if dist.get_rank() == 0:
                torch.save({"exp_avg": every}, a.out + ".moments")
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text("7")
        if opt is not None:  # the step a resumed run must reproduce (logits below are the saved model's)
            model.train()
            losses = {"first": loss, "next": [adam_step(ddp, opt, 6), adam_step(ddp, opt, 7)]}
            model.eval()
    elif a.mode == "resume":
        d = root / "iter_0000007" / d.name
        state = torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        ddp, opt = make_optimizer(model, cfg)
        if not a.weights_only:
            opt.load_state_dict(state["optimizer"])
            if a.distributed_optimizer:
                opt.load_parameter_state(str(d / "distrib_optim.pt"))
        losses = {"next": [adam_step(ddp, opt, 6), adam_step(ddp, opt, 7)]}
        model.eval()
    else:
        tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}") / d.name
        state = torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        args = state["args"]
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
                    "padded_vocab_size", "num_attention_heads", "expert_tensor_parallel_size"):
            assert getattr(args, key) == getattr(run_args(cfg, a.tp, a.ep, a.pp, a.etp), key), key
        model.load_state_dict(state["model"], strict=True)
    if losses is not None and dist.get_rank() == 0:
        torch.save(losses, a.out + ".losses")
    out = logits(model)
    if (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        torch.save({"tokens": TOKENS, "logits": out}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def full_params(model, ep):
    """{global name: full tensor} of every parameter (experts by global index; TP shards gathered the way
    megatron-core's sharded_state_dict stores them: fc1 of a GLU as [all gate; all up]), on every rank."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    mine = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        axis = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        if tp > 1 and axis >= 0:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            if name.endswith("linear_fc1.weight") and cfg_glu(model):
                halves = [x.chunk(2, dim=0) for x in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                t = torch.cat(parts, dim=axis)
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        mine[global_name(".".join(parts), ep)] = t
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def cfg_glu(model):
    return model.config.gated_linear_unit


def dist_job(a, model, cfg, root):
    from megatron.core import dist_checkpointing
    d = root / "iter_0000007"
    # --singleton: the per-expert keys (GLU halves apart) megatron-core writes with singleton_local_shards
    sd = model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": True} if a.singleton else None)
    if a.mode == "save-dist":
        args = run_args(cfg, a.tp, a.ep, a.pp)
        args.ckpt_format = "torch_dist"
        sd.update(args=args, checkpoint_version=3.0, iteration=7)
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(d))
        params = full_params(model, a.ep)
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text("7")
    else:
        tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
        loaded = dist_checkpointing.load(sd, str(d))
        for k in ("args", "iteration", "checkpoint_version"):
            loaded.pop(k, None)
        missing, unexpected = model.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
        params = None
    out = logits(model)
    if (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        torch.save({"tokens": TOKENS, "logits": out, "params": params}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "train", "resume", "load-torch", "save-dist", "load-dist"])
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default --tp)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="mixtral")
    ap.add_argument("--singleton", action="store_true")
    ap.add_argument("--out", required=True)
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
