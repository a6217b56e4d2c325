"""Helper run under `torchrun --nproc-per-node 2` (gloo, CPU) with the real megatron-core package.

  "save DIR --tp T [--pp P] [--arch gpt2|llama] [--with-args] --out FILE"   build a tiny GPTModel, save it with
        dist_checkpointing.save (as megatron-core's simple training loop does); --with-args adds the
        common state a Megatron-LM training run stores (args, checkpoint_version, iteration) and
        the tracker file + iter_0000007/ directory.
  "load DIR --tp T [--pp P] [--arch ...] --out FILE"   load DIR into a fresh GPTModel with
        dist_checkpointing.load (every parameter must be found) and write the common state it saw.
  "load-torch DIR --tp T [--pp P] [--arch ...] --out FILE"   load a torch-format checkpoint the way
        Megatron-LM's load_checkpoint does for --ckpt-format torch: tracker file, iter_XXXXXXX/,
        this rank's mp_rank_XX[_YYY]/model_optim_rng.pt through torch.load, the checkpoint's args
        compared with the run's (as check_checkpoint_args does), then model.load_state_dict(strict=True).
  "bridge|nemo|verl DIR --tp T [--arch ...] --out FILE"   save as that trainer lays out a torch_dist checkpoint,
        no args, its config sidecar beside it; "fsdp_dtensor DIR --arch ... --out FILE" as Megatron-LM's
        --ckpt-format fsdp_dtensor lays it out (tests/mcore_sidecar_helper.py; jobs of this helper so they share
        the other saves' torchrun launch).

Both modes write the model's logits for TOKENS (gathered over TP) to FILE, for comparison with
ckptool's reference forward. With --pp each rank builds only its stage's GPTModel (pre_process on the
first stage, post_process on the last, layer numbers offset as megatron-core computes them; a layer
count that does not divide puts the extra layers on the first stage) and the logits come from running
the stages in order, each handing its hidden states to the next with a point-to-point send. The
load mode also writes every parameter it loaded under its global name (layer index offset by the
stage), so a test can compare them with ckptool's tensors. Several quoted jobs may follow one another on the command line.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
from torchrun_jobs import run_jobs  # noqa: E402,F401 (the other helpers' main loop too, as mcore_dist_helper.run_jobs)
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig

# megatron-core's async filesystem writer calls torch.cuda.synchronize() even for CPU tensors,
if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # its failure all-reduce asks for a CUDA device
    # with PP and tied embeddings the last stage's output-layer copy is moved with .cuda() before the
    # all-reduce that copies the first stage's word embeddings into it; on CPU it stays where it is
    torch.Tensor.cuda = lambda self, *a, **k: self

VOCAB = 100  # padded to 128 by the saving run (divisible_by 64 x TP 2)
PADDED = 128
SEQ = 16
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 99, 4, 8, 15, 16, 23, 42, 7, 0, 3],
                       [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]])

ARCHS = {
    # learned positions, LayerNorm, GeLU, biases, tied embeddings
    "gpt2": dict(cfg=dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
                 model=dict(position_embedding_type="learned_absolute",
                            share_embeddings_and_output_weights=True)),
    # rope, RMSNorm, SwiGLU, GQA, no biases, untied
    "llama": dict(cfg=dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=48, normalization="RMSNorm", gated_linear_unit=True,
                           activation_func=torch.nn.functional.silu, add_bias_linear=False,
                           bias_activation_fusion=False),
                  model=dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)),
}
# MTP (issue 30): the llama model with megatron-core's multi-token-prediction block (--mtp-num-layers 1; its
# loss scaled by TransformerConfig's default mtp_loss_scaling_factor 0.1); build() gives GPTModel its MTP block spec
ARCHS["llama_mtp"] = dict(cfg=dict(ARCHS["llama"]["cfg"], mtp_num_layers=1), model=ARCHS["llama"]["model"])


def build(arch, tp, pp=1):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)  # same on every rank: replicated params (norms, biases) must agree
    a = ARCHS[arch]
    n = a["cfg"]["num_layers"]
    uneven = dict(num_layers_in_first_pipeline_stage=n - (n // pp) * (pp - 1)) if pp > 1 and n % pp else {}
    cfg = TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
                            **uneven, **a["cfg"])
    layer_spec = get_gpt_layer_local_spec(normalization=a["cfg"].get("normalization", "LayerNorm"))
    # with --mtp-num-layers, the MTP block takes the decoder layer's spec, as Megatron-LM's gpt_builders.py does
    # (None on the stages without MTP layers: megatron-core 0.16.1 places them all on the last stage)
    mtp = dict(mtp_block_spec=get_gpt_mtp_block_spec(cfg, layer_spec, use_transformer_engine=False)) \
        if cfg.mtp_num_layers else {}
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec,
                     vocab_size=PADDED, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **a["model"], **mtp)
    with torch.no_grad():  # non-trivial norms and biases so a mix-up shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith(".bias") or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    return model, cfg


def logits(model, tokens=TOKENS):
    """The model's logits for tokens [b, s], gathered over TP, on the last stage (None on the others)."""
    # attention dropout forks the CUDA RNG tracker; dropout is 0 here, so a no-op fork is exact
    import contextlib
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        # explicit causal mask (True = masked): the default one is built on a CUDA device
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(s, b, model.config.hidden_size)  # [s, b, h]
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, pos, attention_mask=mask)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    # [b, s, V/tp] -> gather over TP
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def global_params(model):
    """{name: tensor} of this rank's parameters, decoder layers renamed by their global index (what
    the layer's 1-based layer_number says), gathered from every rank; at TP 1 these are full tensors."""
    mine = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        mine[".".join(parts)] = p.detach().clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def rank_name(pp: int = 1, ep: int = 1) -> str:
    """This rank's directory as Megatron-LM names it in the torch format: mp_rank_TT[_PPP][_EEE]."""
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if pp > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if ep > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return name


def is_writer():
    """The rank that holds the gathered logits: last pipeline stage, first TP rank."""
    return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0


def megatron_args(arch, cfg, tp, pp=1):
    a = ARCHS[arch]
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        group_query_attention=cfg.num_query_groups not in (None, cfg.num_attention_heads),
        num_query_groups=cfg.num_query_groups, max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type=a["model"]["position_embedding_type"],
        normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon,
        swiglu=cfg.gated_linear_unit, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        untie_embeddings_and_output_weights=not a["model"]["share_embeddings_and_output_weights"],
        vocab_size=VOCAB, padded_vocab_size=PADDED, make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch_dist",
        use_legacy_models=False, transformer_impl="local", tokenizer_type="NullTokenizer",
        # the NullTokenizer of Megatron-LM c9dfe34 (2026-04) on: vocab_size tokens, no EOD beyond them
        null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1,
        bias_gelu_fusion=False, openai_gelu=False, rotary_base=10000, rotary_percent=1.0,
        mtp_num_layers=cfg.mtp_num_layers)  # --mtp-num-layers: None without MTP (Megatron-LM's default)


# What Megatron-LM's check_checkpoint_args compares between a torch-format checkpoint's args and
# the loading run's own (with a vocab file given; the parallel sizes from checkpoint_version 3.0 on).
CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                "tensor_model_parallel_size", "pipeline_model_parallel_size")


def load_torch_format(model, root: Path, run_args):
    """This rank's file of a torch-format checkpoint into model, as Megatron-LM loads it; returns the
    common state and the checkpoint's args. Raises if an arg differs or a key is missing or extra."""
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    state = torch.load(d / name / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    args = state["args"]
    for key in CHECKED_ARGS:
        assert getattr(args, key) == getattr(run_args, key), (key, getattr(args, key), getattr(run_args, key))
    assert getattr(args, "add_position_embedding", True) == getattr(run_args, "add_position_embedding", True)
    model.load_state_dict(state["model"], strict=True)
    return {"iteration": state["iteration"], "checkpoint_version": state["checkpoint_version"]}, args


# Trainers whose torch_dist saves mcore_sidecar_helper.py lays out (a mode each).
TRAINER_MODES = ("bridge", "nemo", "verl", "fsdp_dtensor")


def run_job(a):
    if a.mode in TRAINER_MODES:
        sys.modules.setdefault("mcore_dist_helper", sys.modules[__name__])  # run as a script: one module, not two
        import mcore_sidecar_helper  # imports this module back; here to keep the other modes' start as it was
        return mcore_sidecar_helper.run_job(a)
    model, cfg = build(a.arch, a.tp, a.pp)
    rank = dist.get_rank()
    root = Path(a.dir)
    if a.mode == "save":
        sd = model.sharded_state_dict(prefix="")
        target = root
        if a.with_args:
            target = root / "iter_0000007"
            sd["args"] = megatron_args(a.arch, cfg, a.tp, a.pp)
            sd["checkpoint_version"] = 3.0
            sd["iteration"] = 7
        if rank == 0:
            target.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(target))
        if rank == 0 and a.with_args:
            (root / "latest_checkpointed_iteration.txt").write_text("7")
        out = logits(model)
        if is_writer():
            torch.save({"tokens": TOKENS, "logits": out}, a.out)
    elif a.mode == "load-torch":
        common, args = load_torch_format(model, root, megatron_args(a.arch, cfg, a.tp, a.pp))
        out = logits(model)
        if is_writer():
            torch.save({"tokens": TOKENS, "logits": out, "common": common,
                        "args_layout": (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)}, a.out)
    else:
        d = root
        tracker = root / "latest_checkpointed_iteration.txt"
        if tracker.is_file():
            d = root / f"iter_{int(tracker.read_text()):07d}"
        sd = model.sharded_state_dict(prefix="")
        loaded = dist_checkpointing.load(sd, str(d))
        common = {k: loaded.pop(k) for k in ("args", "iteration", "checkpoint_version") if k in loaded}
        missing, unexpected = model.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
        out = logits(model)
        params = global_params(model) if a.tp == 1 else None
        if is_writer():
            torch.save({"tokens": TOKENS, "logits": out, "params": params,
                        "common": {k: v for k, v in common.items() if k != "args"},
                        "args_tp": getattr(common.get("args"), "tensor_model_parallel_size", None)}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    """Each argument is one job: 'mode dir --tp T [--pp P] --arch A [--with-args] --out FILE' (one torchrun
    start for several jobs: importing megatron-core is the slow part)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load", "load-torch", *TRAINER_MODES])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--with-args", action="store_true")
    ap.add_argument("--out", required=True)
    # fsdp_dtensor mode (tests/mcore_sidecar_helper.py): the experts' names, and one optimizer step saved with it
    ap.add_argument("--experts", choices=["sequential", "grouped"], default="sequential")
    ap.add_argument("--optim", action="store_true")
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
