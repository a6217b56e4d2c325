"""Megatron's key names, one dialect per era, as data.

Each dialect maps roles (roles.py) to state-dict keys, read from the model-family spec (spec/gpt.py: each
role's key per name column; ERAS below: which columns a dialect reads, renamed how). Nested state dicts (legacy
`model['language_model'][...]`) are flattened with '/' between dict levels, so a key is a path:
'language_model/encoder/layers.{i}.input_norm.weight'. {i} is the layer index local to the file
(pipeline stage / virtual chunk).

  flat2019      DeepSpeedExamples' Megatron-LM (2019): flat keys, QKV in stride-3 v0 layout
  legacy-2020   nested language_model, transformer / attention / *layernorm (2019-10 .. 2021-01)
  legacy        nested, encoder / self_attention / *layernorm (2021-01 .. 2023-09)
  legacy-norm   nested, encoder / self_attention / *_norm (2023-09 .. 2026)
  mcore         megatron-core GPTModel, local layer spec
  mcore-te      megatron-core GPTModel, Transformer-Engine spec (norms fused into linear_qkv/fc1)
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ..spec import GPT
from ..spec.schema import FLAT, LEGACY, LEGACY_GROUPED, MCORE, SEQUENTIAL, TE, TE_GROUPED, TE_MLA, TE_MOE

if TYPE_CHECKING:  # annotations only: the dialect tables are read without torch (quick inspect)
    import torch


@dataclass(frozen=True)
class Dialect:
    name: str
    globals: Dict[str, str]
    layer_prefix: str
    layer: Dict[str, str]
    head_copy: Optional[str] = None  # where the last stage keeps the tied embedding when PP > 1
    extra_state: Tuple[str, ...] = ()  # per-layer `_extra_state` keys the framework expects
    extra_state_value: str = "none"  # "none" or "empty_bytes" (Transformer Engine)
    global_extra_state: Tuple[str, ...] = ()
    nested: bool = False
    has_args: bool = True
    qkv_version0_only: bool = False  # flat2019: always the v0 per-rank QKV layout
    legacy_models: bool = True
    transformer_impl: str = "local"
    # Per-layer roles in the order the framework registers the parameters (= named_parameters() and
    # state-dict order), which is the order its optimizer groups list them in (megatron_optim.py).
    param_order: Tuple[str, ...] = ()
    # MoE layers (megatron-core): the router / shared-expert roles' keys (layer-relative, like `layer`);
    # each local expert's fc1/fc2 keys, {j} the expert's index local to its expert-parallel rank (the
    # first table is what writers write; later ones are other module forms readers accept); and the
    # extra-state keys of a local expert, of the shared expert.
    moe_layer: Dict[str, str] = dataclasses.field(default_factory=dict)
    experts: Tuple[Dict[str, str], ...] = ()
    expert_extra_state: Tuple[str, ...] = ()
    shared_extra_state: Tuple[str, ...] = ()
    # --moe-grouped-gemm runs: the per-expert table written then (experts fc-major: every local expert's fc1,
    # then every fc2, as a grouped linear registers them) and its extra-state keys; None: not written
    grouped_experts: Optional[Dict[str, str]] = None
    grouped_extra_state: Tuple[str, ...] = ()
    # read only: expert forms holding all local experts of a layer in one tensor per fc (legacy GroupedMLP)
    stacked_experts: Dict[str, str] = dataclasses.field(default_factory=dict)
    # Multi-Latent Attention models: the extra-state keys of its linears (role -> key; a model has those of
    # the roles it holds), in place of linear_qkv's; the keys that differ from `layer` in an MLA model (TE: the
    # input norm stays a module of its own); the layer's parameter order when it differs from param_order
    mla_extra_state: Dict[str, str] = dataclasses.field(default_factory=dict)
    mla_layer: Dict[str, str] = dataclasses.field(default_factory=dict)
    mla_param_order: Tuple[str, ...] = ()
    # the spec column whose TP rules the dialect's modules follow (Role.rules; None: every role's own rule)
    rule_column: Optional[str] = None

    def layer_key(self, role: str, moe: bool = False, mla: bool = False) -> Optional[str]:
        """A layer role's layer-relative key in an MoE layer (moe) of an MLA model (mla), or None."""
        if moe and role in self.moe_layer:
            return self.moe_layer[role]
        if mla and role in self.mla_layer:
            return self.mla_layer[role]
        return self.layer.get(role)

    def layer_param_order(self, mla: bool) -> Tuple[str, ...]:
        return self.mla_param_order if mla and self.mla_param_order else self.param_order


def _rename(table: Dict[str, str], *pairs) -> Dict[str, str]:
    out = {}
    for role, key in table.items():
        for old, new in pairs:
            key = key.replace(old, new)
        out[role] = key
    return out


# The keys come from the spec (spec/gpt.py). Each dialect reads one column of it for the globals and one for the
# layers; the legacy eras are the spec's 2021-2023 names ("legacy" column) with module names renamed.
_ATTENTION_2020 = ("self_attention.", "attention.")
ERAS = {  # dialect -> (globals column, layer column, renames)
    "flat2019": (FLAT, LEGACY, (_ATTENTION_2020,)),
    "legacy-2020": (LEGACY, LEGACY, (("/encoder/", "/transformer/"), _ATTENTION_2020)),
    "legacy": (LEGACY, LEGACY, ()),
    "legacy-norm": (LEGACY, LEGACY, (("input_layernorm", "input_norm"),
                                     ("post_attention_layernorm", "post_attention_norm"),
                                     ("final_layernorm", "final_norm"))),
    "mcore": (MCORE, MCORE, ()),
    "mcore-te": (TE, TE, ()),
}


def _era(name: str) -> Dict[str, object]:
    glob, layer, renames = ERAS[name]
    return dict(globals=_rename(GPT.keys("global", glob), *renames),
                layer=_rename(GPT.keys("layer", layer), *renames))


def _experts(column: str) -> Dict[str, str]:
    """An expert module form's keys by base role (fc1.weight, fc2.weight)."""
    return {GPT.roles[role].base: key for role, key in GPT.keys("expert", column).items()}


def _extra_state(column: str, *roles: str) -> Tuple[str, ...]:
    """The `_extra_state` keys of the linear modules holding these roles (one per module, beside its weight)."""
    return tuple(_extra_state_of(column, *roles).values())


def _extra_state_of(column: str, *roles: str) -> Dict[str, str]:
    """role -> the `_extra_state` key of the linear module holding it."""
    return {r: GPT.roles[r].key(column).rsplit(".", 1)[0] + "._extra_state" for r in roles}


_LINEARS = ("proj.weight", "qkv.weight", "fc1.weight", "fc2.weight")  # megatron-core's registration order
_EXPERT_LINEARS = ("experts.{expert}.fc1.weight", "experts.{expert}.fc2.weight")
_MCORE_EXTRA = _extra_state(MCORE, *_LINEARS)
# megatron-core MoE layers (local spec): TopKRouter, SequentialMLP experts, SharedExpertMLP.
_MCORE_MOE_LAYER = GPT.keys("moe", MCORE)
_SEQUENTIAL_EXPERTS = _experts(SEQUENTIAL)
_SEQUENTIAL_EXPERT_EXTRA = _extra_state(SEQUENTIAL, *_EXPERT_LINEARS)
# TEGroupedMLP (--moe-grouped-gemm with Transformer Engine): one TE GroupedLinear per fc, local expert j's
# weight under `weight{j}`, each laid out as a linear layer's [out / TP, in] (fc1: [gate_r; up_r] when gated).
_TE_GROUPED_EXPERTS = _experts(TE_GROUPED)
_TE_GROUPED_EXTRA = _extra_state(TE_GROUPED, *_EXPERT_LINEARS)
# The legacy GroupedMLP (--moe-grouped-gemm on the local spec, or --moe-use-legacy-grouped-gemm): one tensor per
# fc for all local experts, laid out for grouped_gemm's kernels (stacked_expert_block below).
_LEGACY_GROUPED_EXPERTS = _experts(LEGACY_GROUPED)
_SHARED_EXTRA = _extra_state(MCORE, "shared.fc1.weight", "shared.fc2.weight")


# named_parameters() order of a layer. Legacy: norm, query_key_value, dense, norm, MLP. megatron-core
# registers linear_proj before linear_qkv (Attention.__init__ runs before SelfAttention adds linear_qkv),
# and Transformer Engine's LayerNormLinear registers layer_norm_weight/_bias before weight/bias (read in
# TE's module/layernorm_linear.py; not run here: TE does not install on a CPU-only machine).
_LEGACY_PARAM_ORDER = ("attn_norm.weight", "attn_norm.bias", "qkv.weight", "qkv.bias", "proj.weight",
                       "proj.bias", "mlp_norm.weight", "mlp_norm.bias", "fc1.weight", "fc1.bias",
                       "fc2.weight", "fc2.bias")
_QK_NORMS = ("q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias")
_MLP = ("mlp_norm.weight", "mlp_norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
# MLASelfAttention (megatron-core 0.16 multi_latent_attention.py) registers linear_proj, then its q linear(s)
# (linear_q_proj, or linear_q_down_proj and linear_q_up_proj), the kv linears, and the latent norms last (local
# spec; the TE spec's norms sit inside the up projections, registered before their weights); an MLA model has no
# qkv roles, a GQA model none of these. The TE spec's MLA layer keeps input_layernorm as a module registered
# before self_attention (TransformerLayer.__init__), so there the input norm comes first.
_MLA_LINEARS = ("mla.q.weight", "mla.q_down.weight", "mla.q_up.weight", "mla.kv_down.weight", "mla.kv_up.weight")
_MLA_PARAMS = _MLA_LINEARS + ("mla.q_down_norm.weight", "mla.kv_down_norm.weight")
_MCORE_PARAM_ORDER = (("attn_norm.weight", "attn_norm.bias", "proj.weight", "proj.bias", "qkv.weight", "qkv.bias")
                      + _MLA_PARAMS + _QK_NORMS + _MLP)
_MCORE_TE_PARAM_ORDER = (("proj.weight", "proj.bias", "attn_norm.weight", "attn_norm.bias", "qkv.weight", "qkv.bias")
                         + _QK_NORMS + _MLP)
_MCORE_TE_MLA_PARAM_ORDER = ("attn_norm.weight", "attn_norm.bias", "proj.weight", "proj.bias", "mla.q.weight",
                             "mla.q_down.weight", "mla.q_down_norm.weight", "mla.q_up.weight", "mla.kv_down.weight",
                             "mla.kv_down_norm.weight", "mla.kv_up.weight") + _MLP
# the keys of an MLA layer under Transformer Engine that differ from its GQA layer's (the input norm's)
_TE_MLA_LAYER = {role: key for role, key in GPT.keys("layer", TE_MLA).items() if GPT.keys("layer", TE)[role] != key}


DIALECTS: Dict[str, Dialect] = {d.name: d for d in [
    Dialect("flat2019", layer_prefix="transformer.layers.{i}.", **_era("flat2019"),
            has_args=False, qkv_version0_only=True, param_order=_LEGACY_PARAM_ORDER),
    Dialect("legacy-2020", layer_prefix="language_model/transformer/layers.{i}.", **_era("legacy-2020"),
            head_copy="word_embeddings_for_head/weight", nested=True, param_order=_LEGACY_PARAM_ORDER),
    Dialect("legacy", layer_prefix="language_model/encoder/layers.{i}.", **_era("legacy"),
            head_copy="word_embeddings_for_head/weight", nested=True, param_order=_LEGACY_PARAM_ORDER),
    Dialect("legacy-norm", layer_prefix="language_model/encoder/layers.{i}.", **_era("legacy-norm"),
            head_copy="word_embeddings_for_head/weight", nested=True, param_order=_LEGACY_PARAM_ORDER),
    Dialect("mcore", layer_prefix="decoder.layers.{i}.", **_era("mcore"),
            head_copy="output_layer.weight", extra_state=_MCORE_EXTRA,
            global_extra_state=("output_layer._extra_state",), legacy_models=False,
            param_order=_MCORE_PARAM_ORDER, moe_layer=_MCORE_MOE_LAYER, experts=(_SEQUENTIAL_EXPERTS,),
            expert_extra_state=_SEQUENTIAL_EXPERT_EXTRA, shared_extra_state=_SHARED_EXTRA,
            stacked_experts=_LEGACY_GROUPED_EXPERTS, mla_extra_state=_extra_state_of(MCORE, *_MLA_LINEARS)),
    Dialect("mcore-te", layer_prefix="decoder.layers.{i}.", **_era("mcore-te"), head_copy="output_layer.weight",
            extra_state=_MCORE_EXTRA + ("self_attention.core_attention._extra_state",),
            extra_state_value="empty_bytes", global_extra_state=("output_layer._extra_state",),
            legacy_models=False, transformer_impl="transformer_engine", param_order=_MCORE_TE_PARAM_ORDER,
            # MoE layers keep a separate pre_mlp_layernorm (no fc1 to fuse it into); experts as SequentialMLP
            # of TE linears, or TEGroupedMLP under --moe-grouped-gemm (layouts from megatron-core's
            # experts.py; Transformer Engine itself does not run here), or legacy GroupedMLP (read only)
            moe_layer=dict(GPT.keys("moe", TE), **GPT.keys("layer", TE_MOE)),
            experts=(_SEQUENTIAL_EXPERTS, _TE_GROUPED_EXPERTS), expert_extra_state=_SEQUENTIAL_EXPERT_EXTRA,
            shared_extra_state=_SHARED_EXTRA, grouped_experts=_TE_GROUPED_EXPERTS,
            grouped_extra_state=_TE_GROUPED_EXTRA, stacked_experts=_LEGACY_GROUPED_EXPERTS,
            # MLA (get_gpt_layer_with_transformer_engine_spec; Transformer Engine itself does not run here): the
            # input norm a module of its own, the latent norms inside the up projections, the down projections
            # whole on every TP rank (the spec's TE rules)
            mla_extra_state=_extra_state_of(TE_MLA, *_MLA_LINEARS), mla_layer=_TE_MLA_LAYER,
            mla_param_order=_MCORE_TE_MLA_PARAM_ORDER, rule_column=TE_MLA),
]}


def is_mla(keys) -> bool:
    """Whether a Megatron (torch or torch_dist) checkpoint with these keys is of a Multi-Latent Attention model:
    every MLA layer has a kv down projection, which no other model has. KeyMatcher's mla flag."""
    return any(".linear_kv_down_proj." in k for k in keys)



class KeyMatcher:
    """Recognises a dialect's keys: key -> (role, local layer or None)."""

    def __init__(self, dialect: Dialect, mla: bool = False):
        """mla: the checkpoint is of a Multi-Latent Attention model, whose latent q norm has the key that
        q_norm has in a grouped-query model (self_attention.q_layernorm.weight): one key, the role by model."""
        self.dialect = dialect
        self.globals = {key: role for role, key in dialect.globals.items()}
        if dialect.head_copy:
            self.globals.setdefault(dialect.head_copy, "head_copy")
        prefix = re.escape(dialect.layer_prefix).replace(r"\{i\}", r"(\d+)")
        self.layer_re = re.compile("^" + prefix + "(.+)$")
        self.layer = {}
        for role, suffix in dialect.layer.items():
            if suffix not in self.layer or role.startswith("mla.") == mla:
                self.layer[suffix] = role
        if mla:
            self.layer.update({suffix: role for role, suffix in dialect.mla_layer.items()})
        self.layer.update({suffix: role for role, suffix in dialect.moe_layer.items()})
        # expert keys: (regex of the layer-relative key, its group the local expert) -> base role
        self.experts = [(re.compile("^" + re.escape(key).replace(r"\{j\}", r"(\d+)") + "$"), base)
                        for table in dialect.experts for base, key in table.items()]
        self.stacked = {key: base for base, key in dialect.stacked_experts.items()}

    def match(self, key: str):
        """(role, local layer or None), or None. An expert's role is experts.{j}.<base> with j its index
        LOCAL to the file's expert-parallel rank (the reader makes it global); a tensor of all local
        experts (stacked_experts) has role experts.*.<base>."""
        if key in self.globals:
            return self.globals[key], None
        m = self.layer_re.match(key)
        if not m:
            return None
        if m.group(2) in self.layer:
            return self.layer[m.group(2)], int(m.group(1))
        if m.group(2) in self.stacked:
            return f"experts.*.{self.stacked[m.group(2)]}", int(m.group(1))
        for pattern, base in self.experts:
            e = pattern.match(m.group(2))
            if e:
                return f"experts.{int(e.group(1))}.{base}", int(m.group(1))
        return None


# Keys of modules ckptool knows and does not convert: (pattern, what they are, what to do). The reader names
# them instead of the generic "not part of a GPT model", and never leaves them out of an output.
REFUSED_KEYS = (
    (re.compile(r"(^|[./])mtp[./]"), "multi-token prediction (MTP) layers (--mtp-num-layers)",
     "ckptool does not convert MTP modules yet; convert a checkpoint of a run without MTP"),
    (re.compile(r"(^|[./])mlp\.experts\."), "an MoE expert module ckptool does not know",
     "ckptool reads SequentialMLP (local_experts.{j}), TEGroupedMLP (linear_fc1.weight{j}) and the legacy "
     "GroupedMLP (weight1 / weight2) experts"),
)


def refused_module(key: str):
    """(what, hint) when key belongs to a module of REFUSED_KEYS, else None."""
    for pattern, what, hint in REFUSED_KEYS:
        if pattern.search(key):
            return what, hint
    return None


def is_ignorable(key: str) -> bool:
    """Keys that carry no weights: TE/local extra state, legacy alias params, causal-mask buffers."""
    tail = key.rsplit(".", 1)[-1].rsplit("/", 1)[-1]
    return tail in ("_extra_state", "embedding_param", "masked_bias", "inv_freq")


# --- legacy GroupedMLP: all local experts in one tensor per fc ---------------------------------

def stacked_expert_block(base: str, hidden: int, local_experts: int, size: int) -> Tuple[int, Tuple[int, int]]:
    """(elements per expert, block shape) of local expert j's block, elements j*n .. (j+1)*n - 1 of the
    flattened weight. megatron-core's GroupedMLP (transformer/moe/experts.py) keeps weight1 as
    [hidden, E_local * fc1_r] and weight2 as [E_local * ffn_r, hidden] and views them as
    [E_local, hidden, fc1_r] / [E_local, ffn_r, hidden] for grouped_gemm; its sharded_state_dict transposes
    each block to a linear layer's [out, in] to make the SequentialMLP expert (fc1: [gate_r; up_r])."""
    n = size // local_experts
    return n, ((hidden, n // hidden) if base == "fc1.weight" else (n // hidden, hidden))


def stack_expert_weights(base: str, experts) -> torch.Tensor:
    """The inverse: local experts' [out, in] shards -> GroupedMLP's weight1 / weight2."""
    import torch  # here, not at the top: the quick inspect imports this module without torch
    blocks = torch.stack([x.t() for x in experts])  # [E_local, *block]
    return blocks.reshape(blocks.shape[1], -1) if base == "fc1.weight" else blocks.reshape(-1, blocks.shape[2])


# --- QKV per-rank layouts by checkpoint_version (MHA only; GQA appeared with version 3) ----

def qkv_to_grouped(t: torch.Tensor, version: float, heads_local: int, head_dim: int) -> torch.Tensor:
    """One rank's fused QKV in its stored order -> the grouped per-head [q, k, v] order."""
    rest = t.shape[1:]
    if version == 0:  # [3, np, hd]
        return t.reshape(3, heads_local, head_dim, *rest).transpose(0, 1).reshape(t.shape).contiguous()
    if version == 1:  # [np, hd, 3]
        return t.reshape(heads_local, head_dim, 3, *rest).transpose(1, 2).reshape(t.shape).contiguous()
    return t


def qkv_from_grouped(t: torch.Tensor, version: float, heads_local: int, head_dim: int) -> torch.Tensor:
    rest = t.shape[1:]
    if version == 0:
        return t.reshape(heads_local, 3, head_dim, *rest).transpose(0, 1).reshape(t.shape).contiguous()
    if version == 1:
        return t.reshape(heads_local, 3, head_dim, *rest).transpose(1, 2).reshape(t.shape).contiguous()
    return t
