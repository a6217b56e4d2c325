"""What a model-family spec is made of, and how a config expands it into names. No torch here: the
quick inspect path reads these tables without it.

A spec is two tables (spec/gpt.py is the one family ckptool converts):

  TENSORS  every canonical tensor ONCE, in the order writers stream them (state.expected_names), as a
           Tensor: its name pattern with index axes ({layer}, {expert}), the named predicates a config
           must satisfy for the model to have it (PREDICATES), and the Megatron role that holds it with
           its part of that role when the role is fused (q|k|v of QKV, gate|up of a gated fc1).
  ROLES    every Megatron role ONCE, in the order writers write a layer's roles, as a Role: its
           tensor-parallel rule, how its parts are fused, its key in each name column (COLUMNS) and its
           traits (TRAITS: what the frameworks treat specially about it, e.g. --decoupled-lr).

and, beside them, what the frameworks' modules fix rather than the names: the order a layer's roles are
registered in per name column (REGISTRATION) and an MoE layer's (MOE_REGISTRATION), and the prefix of a
layer's keys per name column (LAYER_PREFIX). spec/__init__.py FAMILIES chooses a family's spec by the
config (config.family).

Formats name Megatron's fused roles, never the canonical parts, so format names live on the Role and a
Tensor reaches them through its role. The format modules' tables (megatron/names.py dialects, dcp/torch_dist.py,
deepspeed/pipeline.py, roles.py) are views built from these two tables.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

# --- name columns of a Role ------------------------------------------------------------------
# Layer roles' keys are relative to the layer (the format adds its layer prefix); globals' are whole keys.
LEGACY = "legacy"          # Megatron-LM legacy models, 2021-01 .. 2023-09 names (other eras: renames of
                           # these, megatron_names.ERAS); globals as the nested '/' path
FLAT = "flat"              # DeepSpeedExamples' 2019 Megatron-LM, flat global keys
MCORE = "mcore"            # megatron-core GPTModel, local layer spec
TE = "te"                  # megatron-core with Transformer Engine (norms fused into linear_qkv / linear_fc1)
TE_MOE = "te-moe"          # the TE name inside an MoE layer, where there is no fc1 to fuse the norm into
TE_MLA = "te-mla"          # the TE name inside a Multi-Latent Attention layer (no linear_qkv to fuse the input norm into)
DIST = "dist"              # torch_dist (megatron-core sharded_state_dict): what ckptool writes
MDS = "mds"                # Megatron-DeepSpeed pipeline layer files: "<file kind>/<key>" for globals
SEQUENTIAL = "sequential"  # experts: SequentialMLP, {j} the expert's index local to its EP rank
TE_GROUPED = "te-grouped"  # experts: TEGroupedMLP (--moe-grouped-gemm with Transformer Engine)
LEGACY_GROUPED = "legacy-grouped"  # experts: legacy GroupedMLP, all local experts in one tensor (read only)
COLUMNS = (LEGACY, FLAT, MCORE, TE, TE_MOE, TE_MLA, DIST, MDS, SEQUENTIAL, TE_GROUPED, LEGACY_GROUPED)
# A column a Role does not list takes the name (and the TP rule, Role.rules) of its fallback column:
FALLBACK = {TE: MCORE, TE_MLA: TE, DIST: TE, MDS: LEGACY}

# --- traits of a Role: what frameworks single out about it, read by the optimizer and pipeline code ---------
TRAITS = {
    # megatron-core marks these parameters is_embedding_or_output_parameter; --decoupled-lr applies to them
    "embedding_or_output": "the word embedding, the output layer, or the last stage's copy of a tied embedding",
    # with tied embeddings and PP > 1 these hold one tensor, kept equal by an all-reduce of their gradients
    "tied_embedding": "the word embedding or a copy of it that a tied output layer uses",
    "first_stage": "a global the first pipeline stage holds (the others: the last stage)",
    "linear": "a linear module's weight: the module carries an `_extra_state` beside it in megatron-core",
    # a module buffer saved with the weights (megatron-core's TopKRouter.expert_bias, updated by its own rule
    # from the tokens each expert got): in no optimizer group and no grad buffer, so it has no optimizer slot
    "buffer": "a module buffer, not a parameter: no optimizer state",
}
# The role of the last pipeline stage's copy of a tied word embedding (PP > 1). It holds no canonical tensor
# (the embedding again), so it is a Role without Tensors: the views of canonical tensors never list it.
HEAD_COPY = "head_copy"


# --- config predicates: when a model has a tensor ---------------------------------------------
# (cfg, layer) -> bool; layer is None for global tensors. A Tensor lists the ones that must all hold.
Predicate = Callable[[object, Optional[int]], bool]
PREDICATES: Dict[str, Predicate] = {
    "learned_pos": lambda c, i: c.position_embedding == "learned",
    "untied": lambda c, i: not c.tied_embeddings,
    "norm_bias": lambda c, i: c.norm_has_bias,              # LayerNorm has a bias, RMSNorm none
    "linear_bias": lambda c, i: c.add_bias_linear,
    "qkv_bias": lambda c, i: c.add_qkv_bias or c.add_bias_linear,
    "qk_norm": lambda c, i: c.qk_layernorm,
    "gated": lambda c, i: c.gated,                           # SwiGLU: fc1 = [gate; up]
    "gqa": lambda c, i: c.mla is None,                       # grouped-query attention (attn.q/k/v)
    "mla": lambda c, i: c.mla is not None,                   # Multi-Latent Attention
    "mla_q_lora": lambda c, i: c.mla is not None and bool(c.mla.q_lora_rank),
    "mla_q_direct": lambda c, i: c.mla is not None and not c.mla.q_lora_rank,  # MLA's q projected straight from h
    "dense_mlp": lambda c, i: not c.is_moe_layer(i),
    "moe": lambda c, i: c.is_moe_layer(i),
    "router_bias": lambda c, i: c.moe.router_bias,
    "expert_bias": lambda c, i: c.moe.expert_bias,
    "shared_expert": lambda c, i: bool(c.moe.shared_ffn_hidden_size),
    "shared_gate": lambda c, i: c.moe.shared_gate,
    "post_norms": lambda c, i: c.post_norms,                 # Gemma: attention and MLP outputs normed (issue 32)
    # --- multi-token prediction (MTP): a layer past the decoder's, holding an MTP module's own tensors ---
    "mtp": lambda c, i: c.is_mtp_layer(i),
    "attn_sinks": lambda c, i: c.attn_sinks,                 # GPT-OSS: a learned softmax sink per head
}
# Predicates that never hold together. A canonical tensor may be listed once per side (attn.q is GQA's q, a part of
# the fused QKV, or MLA's direct q, a role of its own): for any config at most one of the entries holds.
EXCLUSIVE = (("gqa", "mla"), ("gqa", "mla_q_direct"))
# index axes of a name pattern and how many values each takes for a config
AXES: Dict[str, Callable[[object], int]] = {
    "layer": lambda c: c.all_layers,  # the decoder layers, then the MTP layers (GPTConfig.all_layers)
    "expert": lambda c: c.moe.num_experts,
}


@dataclass(frozen=True)
class Tensor:
    """One canonical tensor: `name` with its index axes ({layer}, {expert}), `when` the PREDICATES a
    config must satisfy for the model to have it, `role` the Megatron role (ROLES) holding it (None: no
    Megatron form ckptool writes) and `part` its part of a fused role (q|k|v, gate|up)."""
    name: str
    when: Tuple[str, ...] = ()
    role: Optional[str] = None
    part: Optional[str] = None

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(a for a in AXES if "{" + a + "}" in self.name)

    def holds(self, cfg, layer: Optional[int] = None) -> bool:
        return all(PREDICATES[p](cfg, layer) for p in self.when)

    def format(self, layer: Optional[int] = None, expert: Optional[int] = None) -> str:
        return self.name.format(layer=layer, expert=expert)


@dataclass(frozen=True)
class MtpKeys:
    """Where a multi-token-prediction (MTP) layer's keys live: prefix per name column ({i}: the MTP layer's index
    0 .. mtp_num_layers - 1), the prefix of its decoder layer's keys inside it (`inner`), and its own roles in the
    order the framework registers them: `before` the decoder layer, `after` it. Empty: the family has none."""
    prefix: Mapping[str, str] = field(default_factory=dict)
    inner: str = ""
    before: Tuple[str, ...] = ()
    after: Tuple[str, ...] = ()


# MoE scopes of a role name: one expert's (its {expert} axis) and the shared expert's
SCOPES = ("experts.{expert}.", "shared.")


@dataclass(frozen=True)
class Role:
    """One Megatron role (a tensor as Megatron stores it, possibly fused from canonical parts).

    name: the role; an MoE scope prefixes the base role (shared.fc1.weight, experts.{expert}.fc1.weight)
    and a scoped role shards by its base role's rule. rule: the tensor-parallel rule (a sharding.Rule
    value; None for scoped roles). fused: how the parts sit in the tensor: "qkv" (grouped per query
    group) or "halves" ([gate; up] rows when the model is gated, the GATED rule then). names: column
    (COLUMNS) -> key; a column missing here and in FALLBACK means the format has no such tensor.
    rules: column -> the TP rule where a format's module shards the role otherwise than `rule` (Transformer
    Engine keeps MLA's down projections whole on every rank); followed through FALLBACK like names. traits:
    names from TRAITS."""
    name: str
    rule: Optional[str] = None
    names: Mapping[str, str] = field(default_factory=dict)
    fused: Optional[str] = None
    rules: Mapping[str, str] = field(default_factory=dict)
    traits: Tuple[str, ...] = ()

    @property
    def base(self) -> str:
        """The role without its MoE scope: fc1.weight for experts.{expert}.fc1.weight."""
        for scope in SCOPES:
            if self.name.startswith(scope):
                return self.name[len(scope):]
        return self.name

    @property
    def is_expert(self) -> bool:
        return self.name.startswith(SCOPES[0])

    def key(self, column: str) -> Optional[str]:
        """This role's key in a name column, following FALLBACK; None when the column has none."""
        return _key_by_column(self.names, column)

    def rule_in(self, column: Optional[str]) -> Optional[str]:
        """This role's TP rule in a name column (Role.rules, following FALLBACK); `rule` elsewhere."""
        rule = _key_by_column(self.rules, column)
        return self.rule if rule is None else rule


_EXPERT_ROLE = re.compile(r"^experts\.\d+\.(.+)$")


def fc_major(roles: List[str]) -> List[str]:
    """An MoE layer's roles (Spec.moe_layer_roles) with the experts' fc by fc (every local expert's fc1, then every
    fc2), as a grouped linear registers its weight0 .. weightN-1 (parameter order = optimizer order); the rest in
    place. The torch-format writer and the flat optimizer buffers' layout both order a grouped-GEMM layer by it."""
    experts = [r for r in roles if _EXPERT_ROLE.match(r)]
    first = roles.index(experts[0])
    # stable: local experts in order per fc, each fc's weights before its biases (TE's GroupedLinear registers
    # weight0 .. weightN-1, then bias0 .. biasN-1)
    ordered = sorted(experts, key=lambda r: _EXPERT_ROLE.match(r).group(1).split(".")[0]
                     + ("0" if r.endswith("weight") else "1"))
    return roles[:first] + ordered + [r for r in roles[first:] if not _EXPERT_ROLE.match(r)]


def _key_by_column(table: Mapping[str, object], column: Optional[str]):
    """table[column], following FALLBACK; None when neither the column nor its fallbacks are listed."""
    while column is not None:
        if column in table:
            return table[column]
        column = FALLBACK.get(column)
    return None


class Spec:
    """A family's TENSORS and ROLES with the lookups the format views need.

    registration: name column -> a layer's roles in the order the framework registers their parameters
    (named_parameters() and state-dict order, the order its optimizer lists them in); moe_registration: the
    same for an MoE layer's own roles (router, experts, shared expert), its expert roles where the experts
    sit; layer_prefix: name column -> the prefix of a layer's keys, {i} the layer's index in the file. Both
    per-column tables follow FALLBACK."""

    def __init__(self, tensors: Tuple[Tensor, ...], roles: Tuple[Role, ...],
                 registration: Optional[Mapping[str, Tuple[str, ...]]] = None,
                 moe_registration: Tuple[str, ...] = (), layer_prefix: Optional[Mapping[str, str]] = None,
                 mtp: Optional["MtpKeys"] = None):
        self.mtp = mtp or MtpKeys()
        self.tensors = tensors
        self.roles = {r.name: r for r in roles}
        self.registration = dict(registration or {})
        self.moe_registration = tuple(moe_registration)
        self.layer_prefixes = dict(layer_prefix or {})
        self._patterns = None  # match()'s regexes, compiled on first use
        names = [t.name for t in tensors]
        unknown = {t.role for t in tensors if t.role is not None} - set(self.roles)
        problems = [f"{t.name}: unknown predicate in {t.when}" for t in tensors if not set(t.when) <= set(PREDICATES)]
        problems += [f"{r.name}: unknown name column" for r in roles if not set(r.names) <= set(COLUMNS)]
        problems += [f"{r.name}: unknown trait in {r.traits}" for r in roles if not set(r.traits) <= set(TRAITS)]
        ordered = ([r for order in self.registration.values() for r in order] + list(self.moe_registration)
                   + list(self.mtp.before) + list(self.mtp.after))
        problems += [f"registration order names role {r!r} the spec lacks" for r in ordered if r not in self.roles]
        problems += [f"{c}: unknown name column" for c in list(self.registration) + list(self.layer_prefixes)
                     if c not in COLUMNS]
        if unknown:
            problems.append(f"tensors name roles the spec lacks: {sorted(unknown)}")
        if len(self.roles) != len(roles):
            problems.append("a role listed twice")
        for name in {n for n in names if names.count(n) > 1}:
            whens = [set(t.when) for t in tensors if t.name == name]
            if not all(any(a in w1 and b in w2 or b in w1 and a in w2 for a, b in EXCLUSIVE)
                       for i, w1 in enumerate(whens) for w2 in whens[i + 1:]):
                problems.append(f"{name} listed twice without exclusive predicates (EXCLUSIVE)")
        problems += [f"{r.name}: a rule for an unknown name column" for r in roles if not set(r.rules) <= set(COLUMNS)]
        if problems:  # a mistake in the spec's data: fail at import, not in some writer later
            raise ValueError("; ".join(problems))

    # --- roles by where they live ----------------------------------------------------------
    def tensors_of(self, role: str) -> List[Tensor]:
        return [t for t in self.tensors if t.role == role]

    def parts(self, role: str, cfg, layer: Optional[int] = None) -> List[Tensor]:
        """The canonical tensors a role's tensor holds for cfg, in fused order: the role's Tensors less those
        whose own predicates fail (beyond the ones all of them share, which say whether the role exists at
        all): fc1 holds gate and up for a gated model, up alone otherwise. A role whose shared predicates
        fail for a layer config holds none (qkv in an MLA model, whose direct q has the GQA q's name)."""
        ts = self.tensors_of(role)
        common = set.intersection(*(set(t.when) for t in ts)) if ts else set()
        if layer is not None and not all(PREDICATES[p](cfg, layer) for p in common):
            return []
        return [t for t in ts if all(PREDICATES[p](cfg, layer) for p in t.when if p not in common)]

    def has_role(self, role: str, cfg, layer: Optional[int] = None) -> bool:
        """Whether a model with cfg holds this role's tensor (in that layer): one of its tensors holds."""
        return any(t.holds(cfg, layer) for t in self.tensors_of(role))

    def role_list(self, where: str) -> List[Role]:
        """Roles in ROLES order: "global" (no layer axis), "layer" (every layer of a dense model holds
        them), "moe" (an MoE layer's own: router, shared expert and its gate), "expert" (per expert), "mtp"
        (an MTP layer's own: enorm, hnorm, eh_proj, its final norm)."""
        out = []
        for r in self.roles.values():
            ts = self.tensors_of(r.name)
            if not ts:
                continue
            kind = ("global" if "layer" not in ts[0].axes else "expert" if r.is_expert
                    else "moe" if "moe" in ts[0].when else "mtp" if "mtp" in ts[0].when else "layer")
            if kind == where:
                out.append(r)
        return out

    def with_trait(self, trait: str) -> Tuple[str, ...]:
        """The roles with this trait (TRAITS), in ROLES order."""
        if trait not in TRAITS:
            raise KeyError(f"unknown role trait {trait!r}")
        return tuple(r.name for r in self.roles.values() if trait in r.traits)

    def moe_layer_roles(self, experts) -> List[str]:
        """An MoE layer's own roles (after the attention and mlp_norm) for the given global experts, in
        moe_registration order: the router's, each expert's roles expert by expert, the shared expert's."""
        expert = [self.roles[r].is_expert for r in self.moe_registration]
        first = expert.index(True) if True in expert else len(expert)
        last = len(expert) - expert[::-1].index(True) if True in expert else first
        bases = [self.roles[r].base for r in self.moe_registration[first:last]]
        return (list(self.moe_registration[:first]) + [f"experts.{e}.{b}" for e in experts for b in bases]
                + list(self.moe_registration[last:]))

    def registration_order(self, column: str) -> Tuple[str, ...]:
        """A layer's roles in the order the framework of this name column registers them (FALLBACK applies)."""
        return tuple(_key_by_column(self.registration, column) or ())

    def layer_prefix(self, column: str) -> Optional[str]:
        """The prefix of a layer's keys in this name column, {i} the layer index (FALLBACK applies)."""
        return _key_by_column(self.layer_prefixes, column)

    def mtp_prefix(self, column: str) -> Optional[str]:
        """The prefix of an MTP layer's own keys in this name column, {i} the MTP layer (FALLBACK applies)."""
        return _key_by_column(self.mtp.prefix, column)

    def keys(self, where: str, column: str) -> Dict[str, str]:
        """role -> key in one column, for the roles of `where` that the column names."""
        return {r.name: r.key(column) for r in self.role_list(where) if r.key(column) is not None}

    # --- expansion --------------------------------------------------------------------------
    def expand(self, cfg) -> Iterator[Tuple[str, Tensor, Optional[int], Optional[int]]]:
        """(name, Tensor, layer, expert) of every tensor a model with cfg has, in TENSORS order with
        each run of consecutive same-axis entries repeated over its axis (layer-major, then expert)."""
        yield from self._expand(cfg, list(self.tensors), (), None, None)

    def _expand(self, cfg, tensors, outer, layer, expert):
        i = 0
        while i < len(tensors):
            axis = next((a for a in tensors[i].axes if a not in outer), None)
            if axis is None:
                t = tensors[i]
                if t.holds(cfg, layer):
                    yield t.format(layer, expert), t, layer, expert
                i += 1
                continue
            j = i
            while j < len(tensors) and axis in tensors[j].axes:
                j += 1
            run = tensors[i:j]
            # a whole run is skipped without counting its axis when none of it holds (no MoE: no experts)
            if layer is not None and not any(t.holds(cfg, layer) for t in run):
                i = j
                continue
            for n in range(AXES[axis](cfg)):
                yield from self._expand(cfg, run, outer + (axis,), n if axis == "layer" else layer,
                                        n if axis == "expert" else expert)
            i = j

    def names(self, cfg) -> List[str]:
        return [name for name, _, _, _ in self.expand(cfg)]

    def match(self, name: str, cfg=None) -> Optional[Tuple[Tensor, Optional[int], Optional[int]]]:
        """(Tensor, layer, expert) of a canonical name, or None: the inverse of expand(cfg). Without a config,
        the first Tensor whose pattern fits (a name listed once per exclusive kind, like attn.q, needs cfg)."""
        if self._patterns is None:
            self._patterns = [(re.compile("^" + re.escape(t.name).replace(r"\{layer\}", r"(?P<layer>\d+)")
                                          .replace(r"\{expert\}", r"(?P<expert>\d+)") + "$"), t) for t in self.tensors]
        for pattern, t in self._patterns:
            m = pattern.match(name)
            if m:
                axes = m.groupdict()
                layer = _int(axes.get("layer"))
                if cfg is None or t.holds(cfg, layer):
                    return t, layer, _int(axes.get("expert"))
        return None


def _int(value: Optional[str]) -> Optional[int]:
    return None if value is None else int(value)
