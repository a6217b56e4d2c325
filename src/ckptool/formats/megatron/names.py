"""Megatron's key names, one dialect per era, as data.

Each dialect maps roles (roles.py) to state-dict keys, read from the model-family spec (spec/gpt.py: each
role's key, the layer prefix and the parameter registration order per name column; ERAS below: which
columns a dialect reads, renamed how). dialects(spec) builds them for any family's spec; DIALECTS is
GPT's. Nested state dicts (legacy `model['language_model'][...]`) are flattened with '/' between dict
levels, so a key is a path:
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

from ...errors import CkptError
from ...spec import GPT, spec_for
from ...spec.schema import (FLAT, HEAD_COPY, LEGACY, LEGACY_GROUPED, MCORE, SEQUENTIAL, TE, TE_GROUPED, TE_MLA, TE_MOE,
                           Spec)

if TYPE_CHECKING:  # annotations only: the dialect tables are read without torch (quick inspect)
    import torch


@dataclass(frozen=True)
class Dialect:
    name: str
    globals: Dict[str, str]
    layer_prefix: Optional[str]  # None only while building: the spec has no layer keys in this dialect's column
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
    # state-dict order), which is the order its optimizer groups list them in (megatron/optim.py): the spec's
    # registration order of the dialect's layer column.
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
    # multi-token prediction (megatron-core's MTP block): an MTP layer's prefix ({i}: the MTP layer), the prefix of
    # its decoder layer inside it, and its own roles' keys (relative to the MTP layer); None: no MTP in this dialect
    mtp_prefix: Optional[str] = None
    mtp_inner: str = ""
    mtp_layer: Dict[str, str] = dataclasses.field(default_factory=dict)

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


class _Columns:
    """One spec's keys as the dialects read them (a view: nothing here names a role)."""

    def __init__(self, spec: Spec):
        self.spec = spec

    def era(self, name: str) -> Dict[str, object]:
        """A dialect's key tables from its columns (ERAS): globals, layer roles, the layer prefix, where the last
        stage keeps a tied embedding (the spec's head-copy role) and the order a layer's roles are registered in
        (= named_parameters() and state-dict order, the order the optimizer groups list them in: megatron/optim.py)."""
        glob, layer, renames = ERAS[name]
        head_copy = self.spec.roles.get(HEAD_COPY)
        optional = dict(layer_prefix=self.spec.layer_prefix(glob),
                        head_copy=head_copy.key(glob) if head_copy is not None else None)
        mtp = dict(mtp_prefix=self.spec.mtp_prefix(layer), mtp_inner=self.spec.mtp.inner,
                   mtp_layer=self.spec.keys("mtp", layer)) if self.spec.mtp_prefix(layer) else {}
        return dict(globals=_rename(self.spec.keys("global", glob), *renames),
                    layer=_rename(self.spec.keys("layer", layer), *renames),
                    **{k: v and _rename({k: v}, *renames)[k] for k, v in optional.items()},
                    param_order=self.spec.registration_order(layer), **mtp)

    def experts(self, column: str) -> Dict[str, str]:
        """An expert module form's keys by base role (fc1.weight, fc2.weight)."""
        return {self.spec.roles[role].base: key for role, key in self.spec.keys("expert", column).items()}

    def extra_state(self, column: str, roles) -> Tuple[str, ...]:
        """The `_extra_state` keys of the linear modules holding these roles (one per module, beside its weight)."""
        return tuple(self.extra_state_of(column, roles).values())

    def extra_state_of(self, column: str, roles) -> Dict[str, str]:
        """role -> the `_extra_state` key of the linear module holding it."""
        return {r: self.spec.roles[r].key(column).rsplit(".", 1)[0] + "._extra_state" for r in roles}

    def differing(self, where: str, column: str, base: str) -> Dict[str, str]:
        """The keys of `where`'s roles in `column` that differ from their keys in `base`."""
        base_keys = self.spec.keys(where, base)
        return {role: key for role, key in self.spec.keys(where, column).items() if base_keys.get(role) != key}

    def linears(self, where: str, column: str, mla: bool = False) -> Tuple[str, ...]:
        """The roles of `where` (Spec.role_list) held by linear modules (trait "linear", which carry an
        `_extra_state`), in the column's registration order for layer roles (an MLA model's own apart)."""
        linear = set(self.spec.with_trait("linear"))
        if where == "layer":
            order = self.spec.registration_order(column)
            return tuple(r for r in order if r in linear and self.spec.roles[r].key(column) is not None
                         and r.startswith("mla.") == mla)
        return tuple(r.name for r in self.spec.role_list(where) if r.name in linear)


def dialects(spec: Spec) -> Dict[str, Dialect]:
    """The Megatron dialects of one family's spec (cached per spec: the tables are built once)."""
    if spec not in _DIALECTS_BY_SPEC:
        _DIALECTS_BY_SPEC[spec] = _build_dialects(_Columns(spec))
    return _DIALECTS_BY_SPEC[spec]


def dialects_for(config) -> Dict[str, Dialect]:
    """The Megatron dialects of the family the config says (spec.FAMILIES)."""
    return dialects(spec_for(config))


_DIALECTS_BY_SPEC: Dict[Spec, Dict[str, Dialect]] = {}


def _build_dialects(c: _Columns) -> Dict[str, Dialect]:
    mcore_extra = c.extra_state(MCORE, c.linears("layer", MCORE))
    # megatron-core MoE layers (local spec): TopKRouter, SequentialMLP experts, SharedExpertMLP.
    expert_linears = c.linears("expert", MCORE)
    sequential = c.experts(SEQUENTIAL)
    sequential_extra = c.extra_state(SEQUENTIAL, expert_linears)
    # TEGroupedMLP (--moe-grouped-gemm with Transformer Engine): one TE GroupedLinear per fc, local expert j's
    # weight under `weight{j}`, each laid out as a linear layer's [out / TP, in] (fc1: [gate_r; up_r] when gated).
    te_grouped = c.experts(TE_GROUPED)
    # The legacy GroupedMLP (--moe-grouped-gemm on the local spec, or --moe-use-legacy-grouped-gemm): one tensor
    # per fc for all local experts, laid out for grouped_gemm's kernels (stacked_expert_block below).
    legacy_grouped = c.experts(LEGACY_GROUPED)
    shared_extra = c.extra_state(MCORE, c.linears("moe", MCORE))
    output_extra = c.extra_state(MCORE, c.linears("global", MCORE))
    return {d.name: d for d in [  # (a family whose spec has no layer prefix for a dialect's column lacks it)
        Dialect("flat2019", **c.era("flat2019"), has_args=False, qkv_version0_only=True),
        Dialect("legacy-2020", **c.era("legacy-2020"), nested=True),
        Dialect("legacy", **c.era("legacy"), nested=True),
        Dialect("legacy-norm", **c.era("legacy-norm"), nested=True),
        Dialect("mcore", **c.era("mcore"), extra_state=mcore_extra, global_extra_state=output_extra,
                legacy_models=False, moe_layer=c.spec.keys("moe", MCORE), experts=(sequential,),
                expert_extra_state=sequential_extra, shared_extra_state=shared_extra, stacked_experts=legacy_grouped,
                mla_extra_state=c.extra_state_of(MCORE, c.linears("layer", MCORE, mla=True))),
        Dialect("mcore-te", **c.era("mcore-te"),
                extra_state=mcore_extra + ("self_attention.core_attention._extra_state",),
                extra_state_value="empty_bytes", global_extra_state=output_extra,
                legacy_models=False, transformer_impl="transformer_engine",
                # MoE layers keep a separate pre_mlp_layernorm (no fc1 to fuse it into); experts as SequentialMLP
                # of TE linears, or TEGroupedMLP under --moe-grouped-gemm (layouts from megatron-core's
                # experts.py; Transformer Engine itself does not run here), or legacy GroupedMLP (read only)
                moe_layer=dict(c.spec.keys("moe", TE), **c.spec.keys("layer", TE_MOE)),
                experts=(sequential, te_grouped), expert_extra_state=sequential_extra,
                shared_extra_state=shared_extra, grouped_experts=te_grouped,
                grouped_extra_state=c.extra_state(TE_GROUPED, expert_linears), stacked_experts=legacy_grouped,
                # MLA (get_gpt_layer_with_transformer_engine_spec; Transformer Engine itself does not run here): the
                # input norm a module of its own, the latent norms inside the up projections, the down projections
                # whole on every TP rank (the spec's TE rules)
                mla_extra_state=c.extra_state_of(TE_MLA, c.linears("layer", TE_MLA, mla=True)),
                mla_layer=c.differing("layer", TE_MLA, TE), mla_param_order=c.spec.registration_order(TE_MLA),
                rule_column=TE_MLA),
    ] if d.layer_prefix is not None}


DIALECTS: Dict[str, Dialect] = dialects(GPT)  # the GPT family's, for the readers that detect a dialect by its keys


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
            self.globals.setdefault(dialect.head_copy, HEAD_COPY)
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
        mtp = dialect.mtp_prefix
        self.mtp_re = re.compile("^" + re.escape(mtp).replace(r"\{i\}", r"(\d+)") + "(.+)$") if mtp else None
        self.mtp_own = {key: role for role, key in dialect.mtp_layer.items()}

    def match(self, key: str):
        """(role, local layer or None), or None. An expert's role is experts.{j}.<base> with j its index
        LOCAL to the file's expert-parallel rank (the reader makes it global); a tensor of all local
        experts (stacked_experts) has role experts.*.<base>. A key of MTP layer k (its own roles, or its decoder
        layer's) has the local layer mtp_local(k), a negative number: global_layer places it after the decoder."""
        if key in self.globals:
            return self.globals[key], None
        m = self.mtp_re.match(key) if self.mtp_re is not None else None
        if m:
            k, rest = int(m.group(1)), m.group(2)
            inner = self.dialect.mtp_inner
            role = self.mtp_own.get(rest) or (self._layer_role(rest[len(inner):]) if rest.startswith(inner) else None)
            return None if role is None else (role, mtp_local(k))
        m = self.layer_re.match(key)
        if not m:
            return None
        role = self._layer_role(m.group(2))
        return None if role is None else (role, int(m.group(1)))

    def _layer_role(self, suffix: str) -> Optional[str]:
        """The role of a layer-relative key, or None."""
        if suffix in self.layer:
            return self.layer[suffix]
        if suffix in self.stacked:
            return f"experts.*.{self.stacked[suffix]}"
        for pattern, base in self.experts:
            e = pattern.match(suffix)
            if e:
                return f"experts.{int(e.group(1))}.{base}"
        return None


# --- multi-token prediction: KeyMatcher's local layer of MTP layer k ------------------------------------------
def mtp_local(k: int) -> int:
    """The local layer KeyMatcher.match gives a key of MTP layer k: negative, apart from the decoder's layers."""
    return -1 - k


def global_layer(local: Optional[int], first: int, num_layers: int) -> Optional[int]:
    """A matched key's global layer: a decoder layer's local index plus its chunk's first global layer; MTP layer k
    (mtp_local) is layer num_layers + k, after the decoder's (as Hugging Face numbers it)."""
    if local is None:
        return None
    return first + local if local >= 0 else num_layers - 1 - local


# Keys of modules ckptool knows and does not convert: (pattern, what they are, what to do). The reader names
# them instead of the generic "not part of a GPT model", and never leaves them out of an output.
REFUSED_KEYS = (
    (re.compile(r"(^|[./])mtp[./]"), "multi-token prediction (MTP) layers (--mtp-num-layers) in a dialect without "
     "megatron-core's MTP block", "ckptool reads MTP layers of megatron-core runs (the mcore and mcore-te names)"),
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


def stage_layer_counts(models, matcher: "KeyMatcher") -> Dict[Tuple[int, int], int]:
    """Layers per (pipeline stage, virtual chunk) of a rank's flattened model chunks ({(tp, pp, ep): {chunk: keys}}),
    counted from the keys (each file numbers its layers from 0; MTP layers, numbered below 0, not counted); the same
    on every TP rank, else CkptError. Torch-free: the full reader and the quick inspect count alike."""
    counts: Dict[Tuple[int, int], int] = {}
    for (_, p, _), chunks in models.items():
        for v, flat in chunks.items():
            idx = [m[1] for m in (matcher.match(k) for k in flat) if m and m[1] is not None and m[1] >= 0]
            n = max(idx) + 1 if idx else 0
            if counts.setdefault((p, v), n) != n:
                raise CkptError(f"pipeline stage {p} holds {counts[(p, v)]} layers on one TP rank and {n} on another",
                                "the rank files do not belong to one checkpoint")
    return counts
