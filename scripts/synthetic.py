"""Synthetic GPT-2-style Megatron checkpoints of a chosen size, for benchmarks and memory tests.

The model exists only as lazy tensors whose bytes are generated when the writer asks for them (one
layer at a time), so a checkpoint larger than memory can be written. Values are uniform random in
bf16 from a generator seeded per tensor name: deterministic, incompressible, never NaN. Written with
ckptool's own Megatron writer, so the files carry args the way Megatron writes them.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from ckptool.config import GPTConfig, Layout, MoE
from ckptool.formats.megatron.checkpoint import write_megatron
from ckptool.lazy import Derived
from ckptool.state import Checkpoint, OptimizerState, ParamGroup, SourceInfo, expected_names
from ckptool.write_options import WriteOptions
from make_random_gpt import LLAMA_STYLE, canonical_shape

VOCAB = 50257  # GPT-2's tokenizer; padded to 50304 for TP <= 2 with divisor 128
MAX_POS = 2048


def _random(name: str, shape, dtype) -> Derived:
    seed = zlib.crc32(name.encode())

    def make():
        # A random 1 Mi-element block tiled over the tensor: as incompressible as random data
        # for file I/O, and ~10x cheaper than drawing every element (30 GB must not take an hour).
        g = torch.Generator().manual_seed(seed)
        numel = 1
        for s in shape:
            numel *= s
        block = torch.empty(min(numel, 1 << 20), dtype=dtype).uniform_(-0.05, 0.05, generator=g)
        out = torch.empty(numel, dtype=dtype)
        out.view(-1)[: numel - numel % block.numel()].view(-1, block.numel()).copy_(block)
        out[numel - numel % block.numel():] = block[: numel % block.numel()]
        return out.view(shape)

    return Derived(make, [], memo=True, shape=shape, dtype=dtype)  # TP shards share one draw


STYLES = ("gpt2", "llama", "moe")
MOE_EXPERTS = 8  # the moe style: Mixtral's grid (8 experts, top 2, every layer), written at EP2


def config_for_size(size_gb: float, style: str = "gpt2") -> GPTConfig:
    """A config whose bf16 weights total about size_gb (1e9 bytes).

    gpt2: learned positions, LayerNorm with bias, GELU, biases, tied embedding (to-hf must
    transpose every linear weight into Conv1D's [in, out]). llama: RoPE, RMSNorm, SwiGLU, no
    biases, grouped-query attention (4 query heads per KV head), untied output (to-hf copies every
    weight as it is stored: no transposes). moe: the llama style with every MLP a Mixture of
    MOE_EXPERTS experts (top 2) of a quarter of the dense FFN size each, so a layer holds twice
    the dense layer's MLP bytes, in MOE_EXPERTS x 3 expert tensors plus the router."""
    hidden = 1024 if size_gb < 1 else 2048 if size_gb <= 8 else 4096
    if style == "moe":
        heads, groups, ffn = hidden // 128, hidden // 512, int(hidden * 8 / 3) // 256 * 256
        expert_ffn = ffn // 4
        per_layer = 2 * (hidden * hidden * (2 + 2 * groups / heads) + MOE_EXPERTS * 3 * hidden * expert_ffn
                         + MOE_EXPERTS * hidden + 2 * hidden)
        fixed = 2 * 2 * 32000 * hidden
        layers = max(2, 2 * round((size_gb * 1e9 - fixed) / per_layer / 2))
        return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_query_groups=groups, ffn_hidden_size=expert_ffn, padded_vocab_size=32000,
                         vocab_size=32000, vocab_size_source="synthetic", max_position_embeddings=4096,
                         moe=MoE(num_experts=MOE_EXPERTS, top_k=2, ffn_hidden_size=expert_ffn,
                                 layers=tuple(range(layers))), **LLAMA_STYLE)
    if style == "llama":
        heads, groups, ffn = hidden // 128, hidden // 512, int(hidden * 8 / 3) // 256 * 256
        per_layer = 2 * (hidden * hidden * (2 + 2 * groups / heads) + 3 * hidden * ffn + 2 * hidden)
        fixed = 2 * 2 * 32000 * hidden
        layers = max(2, 2 * round((size_gb * 1e9 - fixed) / per_layer / 2))  # even: PP2 splits it
        return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_query_groups=groups, ffn_hidden_size=ffn, padded_vocab_size=32000,
                         vocab_size=32000, vocab_size_source="synthetic", max_position_embeddings=4096,
                         **LLAMA_STYLE)
    per_layer = 2 * (12 * hidden * hidden + 13 * hidden)
    fixed = 2 * (50304 + MAX_POS) * hidden
    layers = max(2, 2 * round((size_gb * 1e9 - fixed) / per_layer / 2))  # even: PP2 splits it
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                     ffn_hidden_size=4 * hidden, padded_vocab_size=50304, vocab_size=VOCAB,
                     vocab_size_source="synthetic", max_position_embeddings=MAX_POS,
                     activation="gelu")


def synthetic_checkpoint(cfg: GPTConfig, dtype=torch.bfloat16, optimizer: bool = False) -> Checkpoint:
    """optimizer: also a training state as Megatron's bf16 mixed precision keeps it: fp32 masters that
    round to the weights, Adam moments (random, exp_avg_sq positive), step, two param groups, scheduler."""
    tensors = {n: _random(n, _shape(cfg, n), dtype) for n in expected_names(cfg)}
    ckpt = Checkpoint(cfg, tensors, SourceInfo(path="<synthetic>", format="synthetic", dialect="mcore"))
    if optimizer:
        ckpt.optimizer = _training_state(tensors)
    return ckpt


def _shape(cfg: GPTConfig, name: str) -> tuple:
    """canonical_shape, plus the MoE router ([experts, hidden]); an expert's gate/up/down take the
    model's ffn_hidden_size, which the moe style sets to the expert size (every layer is MoE)."""
    if name.endswith("router.weight"):
        return (cfg.moe.num_experts, cfg.hidden_size)
    return canonical_shape(cfg, name)


def _training_state(tensors) -> OptimizerState:
    def moment(name, shape, positive):
        r = _random(name, shape, torch.float32)
        return Derived(lambda x: x.abs() * 1e-3 if positive else x * 1e-2, [r])

    slots = {"master": {n: Derived(lambda w: w.float(), [t]) for n, t in tensors.items()},
             "exp_avg": {n: moment(n + "/exp_avg", t.shape, False) for n, t in tensors.items()},
             "exp_avg_sq": {n: moment(n + "/exp_avg_sq", t.shape, True) for n, t in tensors.items()}}
    no_decay = [n for n, t in tensors.items() if len(t.shape) == 1 or n.endswith("bias")]
    decay = [n for n in tensors if n not in no_decay]
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "max_lr": 3e-4, "min_lr": 3e-5, "lr_mult": 1.0}
    groups = [ParamGroup(decay, dict(hyper, weight_decay=0.1, wd_mult=1.0)),
              ParamGroup(no_decay, dict(hyper, weight_decay=0.0, wd_mult=0.0))]
    scheduler = {"max_lr": 3e-4, "lr_warmup_steps": 100, "num_steps": 1000, "lr_decay_style": "cosine",
                 "lr_decay_steps": 10000, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1,
                 "wd_incr_style": "constant", "wd_incr_steps": 10000}
    return OptimizerState("megatron", slots, step=1000, param_groups=groups, scheduler=scheduler)


def largest_layer_bytes(cfg: GPTConfig, itemsize: int = 2) -> int:
    """Bytes of the largest unit a conversion holds at once: one transformer layer or the embedding."""
    layer = sum(itemsize * (1 if len(s) == 1 else s[0] * s[1])
                for s in (_shape(cfg, n) for n in expected_names(cfg) if n.startswith("layers.0.")))
    return max(layer, itemsize * cfg.padded_vocab_size * cfg.hidden_size)


def write_synthetic(out: Path, size_gb: float = 0.0, tp: int = 2, pp: int = 2, dialect: str = "mcore",
                    cfg: GPTConfig = None, style: str = "gpt2", optimizer: bool = False) -> GPTConfig:
    """Write a Megatron torch-format checkpoint of about size_gb of weights (or of cfg) into out (a new
    directory); optimizer adds the training state (fp32 master + 2 moments: 6x the bf16 weights' bytes)."""
    cfg = cfg or config_for_size(size_gb, style)
    Path(out).mkdir(parents=True, exist_ok=False)
    layout = Layout(tp=tp, pp=pp, ep=2 if cfg.moe else 1)
    write_megatron(synthetic_checkpoint(cfg, optimizer=optimizer), Path(out), layout,
                   WriteOptions(dialect=dialect, iteration=1000), warn=lambda m: None)
    return cfg


if __name__ == "__main__":  # python scripts/synthetic.py OUT SIZE_GB [gpt2|llama]
    import sys
    c = write_synthetic(Path(sys.argv[1]), float(sys.argv[2]), style=(sys.argv[3:] or ["gpt2"])[0])
    print(f"{c.num_layers} layers, hidden {c.hidden_size}")
