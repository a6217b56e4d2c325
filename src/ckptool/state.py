"""The canonical GPT state every reader produces and every writer consumes.

A Checkpoint is a GPTConfig, full (unsharded) LazyTensors under canonical names, and where it came
from. Canonical names say what a tensor IS, never where a framework kept it; layer indices are
global (ckptool/spec/gpt.py lists each once, with the config condition under which a model has it):

  embed.word [V_rows, h]         embed.pos [max_pos, h] (learned positions only)
  layers.{i}.attn_norm.{weight,bias}
  layers.{i}.attn.{q,k,v}.{weight,bias}   q [nq*hd, h], k and v [ng*hd, h]
  layers.{i}.attn.{q_norm,k_norm}.{weight,bias}  (qk_layernorm only)
  layers.{i}.attn.out.{weight,bias}       [h, nq*hd]
  MLA models (config.mla) instead of attn.q/k/v (r = qk_rope_head_dim, qk = nope + r):
  layers.{i}.attn.q_down.weight [q_lora, h], .q_down_norm.weight [q_lora], .q_up.weight [nq*qk, q_lora]
    (or attn.q.weight [nq*qk, h] when q_lora_rank is None)
  layers.{i}.attn.kv_down.weight [kv_lora + r, h], .kv_down_norm.weight [kv_lora],
  layers.{i}.attn.kv_up.weight [nq*(nope + v_head_dim), kv_lora], attn.out.weight [h, nq*v_head_dim]
  layers.{i}.mlp_norm.{weight,bias}
  layers.{i}.mlp.{gate,up}.{weight,bias}  [ffn, h] (gate only for gated MLPs)
  layers.{i}.mlp.down.{weight,bias}       [h, ffn]
  MoE layers (config.moe.layers) instead of mlp.{gate,up,down}; e is the global expert index:
  layers.{i}.mlp.router.weight [E, h]     (.bias, .expert_bias [E] where the model has them)
  layers.{i}.mlp.experts.{e}.{gate,up}.weight [moe_ffn, h], .down.weight [h, moe_ffn]
  layers.{i}.mlp.shared.{gate,up}.weight [shared_ffn, h], .down.weight [h, shared_ffn]
  layers.{i}.mlp.shared_gate.weight [1, h]   (Qwen2-MoE)
  final_norm.{weight,bias}
  output.weight [V_rows, h]               (untied models only)

V_rows is config.padded_vocab_size (what the source stored); config.vocab_size is the true
vocabulary when known. Writers re-pad or trim at the edges (vocab.py).

Slots. A training state holds several values per canonical tensor: the model's own weight
(Checkpoint.tensors) and the optimizer's fp32 master and Adam moments (Checkpoint.optimizer.slots).
Every slot uses the same canonical names and full shapes, so the one split/merge table (QKV groups,
gated halves, vocabulary padding) applies to each slot unchanged; only how a NEW padding row is filled
differs per slot (PAD_FILL_BY_SLOT). Scalar training state (step, param groups, loss scaler, LR
scheduler) lives beside the slots in OptimizerState.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

from .config import GPTConfig, Layout
from .spec import spec_for

if TYPE_CHECKING:  # annotations only: the state itself needs no torch (quick_inspect.py builds one without)
    from .lazy import LazyTensor

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass
class SourceInfo:
    """Where a Checkpoint came from. Writers take values from here (iteration, args, release, a
    Megatron dialect to keep) but never branch on `format`: what a format can do is the format
    table's (formats/registry.py).

    format: the table's name of the format that read it (megatron, torch_dist, deepspeed, hf).
    dialect: which variant of that format, for every format the same thing: how the tensors are named
    inside the format: the Megatron key dialect (megatron_names.DIALECTS) of torch files, mcore-dist or
    mcore-dist-per-layer for torch_dist, the config's model_type for Hugging Face, and for DeepSpeed the
    model naming inside the engine. inspect prints it; code never parses it, and only an exact DIALECTS
    name is reused (as the default output dialect).
    storage: how the weights were kept, where a format has several ways: for DeepSpeed the ZeRO stage
    (or BF16_Optimizer), which weights were read and their dtype; "" for the others. A label for people.
    release: a Megatron release checkpoint (release/ instead of iter_*), which Megatron writers keep.
    args: the Megatron training run's argparse.Namespace where the source stores one (Megatron torch,
    torch_dist, Megatron-DeepSpeed), else None; Megatron writers start from it.
    hf_experts: how the Hugging Face model this state came from stored its experts (HF_EXPERT_FORMS: "per-expert"
    Hub names or transformers 5's "fused" 3-D tensors), None if it did not come from one or has no experts. The HF
    writer writes that form again; Megatron writers keep it in args (HF_EXPERTS_ARG), where their readers find it,
    so from-hf -> reshard -> to-hf writes the experts as the source repository had them."""
    path: str
    format: str
    dialect: str = ""
    storage: str = ""
    layout: Layout = field(default_factory=Layout)
    iteration: Optional[int] = None
    release: bool = False
    checkpoint_version: Optional[float] = None
    args: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)
    hf_experts: Optional[str] = None

    def __post_init__(self):
        if self.hf_experts is None:  # a Megatron run ckptool wrote from a Hugging Face model
            self.hf_experts = getattr(self.args, HF_EXPERTS_ARG, None)

    @property
    def variant(self) -> str:
        """dialect and storage as one label for people ("megatron module (mcore), zero-2, master weights (float32)")."""
        return ", ".join(x for x in (self.dialect, self.storage) if x)


# How a Hugging Face directory stores MoE experts (SourceInfo.hf_experts; to-hf --experts): per expert under the Hub
# names (mlp.experts.{e}.gate_proj.weight ...) or fused 3-D ([E, 2I, h] gate_up_proj, [E, h, I] down_proj)
HF_EXPERT_FORMS = ("per-expert", "fused")
HF_EXPERTS_ARG = "ckptool_hf_experts"  # the Megatron args attribute that keeps SourceInfo.hf_experts

WEIGHT = "weight"
OPTIMIZER_SLOTS = ("master", "exp_avg", "exp_avg_sq")
SLOTS = (WEIGHT,) + OPTIMIZER_SLOTS

# How rows added by vocabulary re-padding are filled, per optimizer slot: the moments of a row that was
# never trained are zero; its fp32 master equals the (padded) model weight row.
PAD_FILL_BY_SLOT = {"master": "from-weight", "exp_avg": "zero", "exp_avg_sq": "zero"}


@dataclass
class ParamGroup:
    """One optimizer param group: its hyperparameters as stored (lr, weight_decay, betas, eps, wd_mult,
    lr_mult, max_lr, ... : whatever keys the framework matches groups by) and the canonical names it holds.
    Layout-made splits are not separate groups: megatron-core's expert-parallel copy of a group (its
    second, chained optimizer at EP > 1) is the same ParamGroup; writers re-form such splits for the
    target layout (formats/megatron/optim.py target_groups)."""
    names: List[str]
    hyper: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerState:
    """The training state beside the weights (Adam as Megatron and DeepSpeed run it).

    slots: slot name ("master", "exp_avg", "exp_avg_sq") -> canonical name -> full lazy tensor, keyed
    exactly like Checkpoint.tensors. Scalars are kept as the source stored them; `kind` says which
    optimizer layout they came from (e.g. "megatron", "megatron-distributed", "deepspeed-zero2").
    RNG state is never carried (Megatron resumes with --no-load-rng).
    """
    kind: str
    slots: Dict[str, Dict[str, LazyTensor]]
    step: Optional[int] = None
    param_groups: List[ParamGroup] = field(default_factory=list)
    grad_scaler: Optional[dict] = None
    scheduler: Optional[dict] = None
    consumed_samples: Optional[int] = None

    def slot_names(self) -> List[str]:
        return [s for s in OPTIMIZER_SLOTS if s in self.slots]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for slot in self.slots.values() for t in slot.values())

    def with_slots(self, slots: Dict[str, Dict[str, LazyTensor]]) -> "OptimizerState":
        return OptimizerState(self.kind, slots, self.step, self.param_groups, self.grad_scaler,
                              self.scheduler, self.consumed_samples)


@dataclass
class Checkpoint:
    config: GPTConfig
    tensors: Dict[str, LazyTensor]
    source: SourceInfo
    warnings: List[str] = field(default_factory=list)
    optimizer: Optional[OptimizerState] = None  # None: weights only

    def slot(self, name: str) -> Dict[str, LazyTensor]:
        """The tensors of one slot: WEIGHT is self.tensors, the others the optimizer's."""
        if name == WEIGHT:
            return self.tensors
        return self.optimizer.slots.get(name, {}) if self.optimizer else {}

    def slots(self) -> List[str]:
        return [WEIGHT] + (self.optimizer.slot_names() if self.optimizer else [])

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    # --- grouping for streaming writers ----------------------------------------------------
    def layer_of(self, name: str) -> Optional[int]:
        m = _LAYER.match(name)
        return int(m.group(1)) if m else None

    def layer_tensors(self, i: int) -> Dict[str, LazyTensor]:
        prefix = f"layers.{i}."
        return {k: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def groups(self) -> Iterator[Tuple[str, Dict[str, LazyTensor]]]:
        """("embed", ...), ("layer i", ...) for each layer, ("head", ...): the order writers stream."""
        head = {k: v for k, v in self.tensors.items() if k.startswith("embed.")}
        yield "embed", head
        by_layer: Dict[int, Dict[str, LazyTensor]] = {}
        for k, v in self.tensors.items():
            i = self.layer_of(k)
            if i is not None:
                by_layer.setdefault(i, {})[k] = v
        for i in sorted(by_layer):
            yield f"layer {i}", by_layer[i]
        yield "head", {k: v for k, v in self.tensors.items()
                       if k.startswith("final_norm.") or k == "output.weight"}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def with_tensors(self, tensors: Dict[str, LazyTensor], **config_changes) -> "Checkpoint":
        return Checkpoint(self.config.replace(**config_changes) if config_changes else self.config,
                          tensors, self.source, self.warnings, self.optimizer)


def in_model_order(tensors: Dict[str, LazyTensor], cfg: GPTConfig) -> Dict[str, LazyTensor]:
    """tensors in expected_names order (the order writers stream); names it does not list go last."""
    order = {n: i for i, n in enumerate(expected_names(cfg))}
    return dict(sorted(tensors.items(), key=lambda kv: (order.get(kv[0], 1 << 30), kv[0])))


def expected_names(cfg: GPTConfig) -> List[str]:
    """Every canonical tensor name a model with this config has, in streaming order (its family's spec:
    spec/gpt.py for a GPTConfig)."""
    return spec_for(cfg).names(cfg)


# --- multi-token prediction (MTP) ---
def without_mtp(ckpt: Checkpoint, warn: Callable[[str], None]) -> Checkpoint:
    """ckpt without its MTP layers (--drop-mtp: what a target that cannot hold them may be given instead), saying
    what was dropped; the main model, whose logits do not depend on them, stays whole. ckpt itself when it has none."""
    cfg = ckpt.config
    if not cfg.mtp_num_layers:
        return ckpt
    kept = set(expected_names(cfg.replace(mtp_num_layers=0)))
    dropped = [n for n in ckpt.tensors if n not in kept]
    warn(f"--drop-mtp: dropped the {cfg.mtp_num_layers} multi-token-prediction (MTP) layer(s) (layers "
         f"{cfg.num_layers}..{cfg.all_layers - 1}, {len(dropped)} tensors"
         + (" and their optimizer state" if ckpt.optimizer is not None else "") + ")")
    out = ckpt.with_tensors({n: t for n, t in ckpt.tensors.items() if n in kept}, mtp_num_layers=0)
    if ckpt.optimizer is not None:
        out.optimizer = ckpt.optimizer.with_slots({slot: {n: t for n, t in ts.items() if n in kept}
                                                   for slot, ts in ckpt.optimizer.slots.items()})
    return out
