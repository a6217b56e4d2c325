"""Megatron's fused tensors ("roles") and how they map onto canonical tensors.

Megatron-LM, megatron-core (torch and torch_dist) and Megatron-DeepSpeed all store a GPT as the
same fused pieces under different names: one QKV matrix in grouped order, fc1 holding gate and up
for gated MLPs, and so on. A format module only maps its names onto these roles; this module owns
the maths shared by all of them:

  RoleTables   a family spec's role tables (tables_for(cfg) picks the config's family): role -> tensor-
               parallel rule (the one sharding table), global / per-layer roles, the MoE layer's order;
               ROLE_RULES, LAYER_ROLES, ... below are the GPT family's, and the trait sets from the spec
  fuse_*/unfuse_*  grouped QKV <-> q, k, v and [gate; up] <-> gate, up
  assemble()   per-rank role shards -> canonical lazy tensors (readers)
  layer_role_tensor(), shard_role()  canonical tensors -> a role's fused tensor -> per-rank shards (writers)

Canonical names (state.py documents them): embed.word, embed.pos, layers.{i}.attn_norm.*,
layers.{i}.attn.{q,k,v}.*, layers.{i}.attn.{q_norm,k_norm}.*, layers.{i}.attn.out.*,
layers.{i}.mlp_norm.*, layers.{i}.mlp.{gate,up,down}.*, final_norm.*, output.weight.

MoE layers add an expert axis as a role prefix (MLP_SCOPES): role `experts.{e}.fc1.weight` is fc1 of
global expert e (canonical layers.{i}.mlp.experts.{e}.{gate,up}.weight), `shared.fc2.weight` the shared
expert's fc2; a scoped role is sharded by its base role's rule (experts' TP is Megatron's expert TP).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .config import GPTConfig
from .errors import CkptError
from .lazy import Derived, LazyTensor, Placement, cat, cat_shape
from .sharding import ReplicaPolicy, Rule, merge_lazy, split_lazy
from .spec import GPT, spec_for, schema
from .spec.schema import Spec

# The tables below are views of a model-family spec (spec/gpt.py lists each role and canonical tensor once),
# built per spec (RoleTables) and chosen by the config (tables_for); the module-level names are the GPT
# family's, for the callers that have no config at hand (format detection, the optimizer's role tables).

# MLP scopes of MoE layers: role prefix (regex, its group the global expert) -> canonical prefix. The
# unscoped roles are the dense MLP's, under "mlp.". Scoped roles use the MLP roles fc1/fc2 underneath.
MLP_SCOPES = ((re.compile(r"^experts\.(\d+)\.(.+)$"), "mlp.experts.{}."),
              (re.compile(r"^shared\.()(.+)$"), "mlp.shared."))
_LAYER = "layers.{layer}."


@dataclass(frozen=True)
class RoleTables:
    """One spec's role tables.

    rules: role -> rule (a role fused of halves, fc1, is GATED for SwiGLU models and COLUMN otherwise: rule_for).
    global_roles: global (non-layer) role -> canonical name. layer_simple: per-layer roles that map one-to-one
    onto a canonical tensor (unscoped, unfused), canonical name relative to the layer ("mlp." the scope's
    prefix). layer_roles: the roles every layer of a dense model has, in the order writers write them.
    moe_router / moe_expert (base roles) / moe_shared: an MoE layer's own roles in the framework's registration
    order (spec.moe_registration), the experts between. The trait sets: spec.with_trait of each schema.TRAITS."""
    spec: Spec
    rules: Dict[str, Rule]
    global_roles: Dict[str, str]
    layer_simple: Dict[str, str]
    layer_roles: Tuple[str, ...]
    moe_router: Tuple[str, ...]
    moe_expert: Tuple[str, ...]
    moe_shared: Tuple[str, ...]
    tied_embedding: Optional[str]  # the canonical tensor the tied_embedding roles share

    @classmethod
    def of(cls, spec: Spec) -> "RoleTables":
        experts = [i for i, r in enumerate(spec.moe_registration) if spec.roles[r].is_expert]
        first, last = (experts[0], experts[-1] + 1) if experts else (len(spec.moe_registration),) * 2
        return cls(
            spec=spec,
            rules={r.name: Rule(r.rule) for r in spec.roles.values() if r.rule is not None},
            global_roles={t.role: t.name for t in spec.tensors if t.role is not None and not t.axes},
            layer_simple={t.role: t.name[len(_LAYER):] for t in spec.tensors
                          if t.role is not None and t.axes == ("layer",) and t.part is None
                          and spec.roles[t.role].base == t.role},
            layer_roles=tuple(r.name for r in spec.role_list("layer")),
            moe_router=spec.moe_registration[:first],
            moe_expert=tuple(spec.roles[r].base for r in spec.moe_registration[first:last]),
            moe_shared=spec.moe_registration[last:],
            tied_embedding=next((t.name for t in spec.tensors if t.role in spec.with_trait("tied_embedding")
                                 and not t.axes), None))


@functools.lru_cache(maxsize=None)
def tables(spec: Spec) -> RoleTables:
    return RoleTables.of(spec)


def tables_for(cfg) -> RoleTables:
    """The role tables of the family the config says (spec.FAMILIES)."""
    return tables(spec_for(cfg))


_GPT = tables(GPT)
ROLE_RULES: Dict[str, Rule] = _GPT.rules
MOE_ROUTER_ROLES = _GPT.moe_router
MOE_EXPERT_ROLES = _GPT.moe_expert
MOE_SHARED_ROLES = _GPT.moe_shared
GLOBAL_ROLES = _GPT.global_roles
LAYER_SIMPLE = _GPT.layer_simple
LAYER_ROLES = _GPT.layer_roles
# Roles the frameworks single out (the spec's role traits, schema.TRAITS): --decoupled-lr applies to the
# embedding and output parameters; with tied embeddings and PP > 1 these hold one tensor between stages;
# a global the first pipeline stage holds (the others sit on the last).
HEAD_COPY = schema.HEAD_COPY
EMBEDDING_OR_OUTPUT_ROLES = frozenset(GPT.with_trait("embedding_or_output"))
TIED_EMBEDDING_ROLES = frozenset(GPT.with_trait("tied_embedding"))
FIRST_STAGE_ROLES = GPT.with_trait("first_stage")
LAST_STAGE_ROLES = tuple(r for r in GLOBAL_ROLES if r not in FIRST_STAGE_ROLES)
# Roles that are module buffers, not parameters (spec trait "buffer": the router's expert bias): saved with
# the weights, but no optimizer holds them, so they have no optimizer slot and no place in a grad buffer.
BUFFER_ROLES = GPT.with_trait("buffer")
_BUFFER_NAMES = re.compile("|".join(
    "^" + re.escape(t.name).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+") + "$"
    for t in GPT.tensors if t.role in BUFFER_ROLES) or "(?!)")


def is_parameter(name: str) -> bool:
    """Whether a canonical tensor is a parameter (has optimizer slots), not a module buffer."""
    return _BUFFER_NAMES.match(name) is None




def scope_of(role: str) -> Tuple[str, str]:
    """(canonical MLP prefix, base role): ("mlp.experts.3.", "fc1.weight") for experts.3.fc1.weight;
    ("mlp.", role) for every unscoped role."""
    for pattern, prefix in MLP_SCOPES:
        m = pattern.match(role)
        if m:
            return prefix.format(m.group(1)), m.group(2)
    return "mlp.", role


def expert_role(e: int, base: str) -> str:
    return f"experts.{e}.{base}"


def moe_layer_roles(cfg: GPTConfig, experts) -> List[str]:
    """An MoE layer's roles after the attention and mlp_norm, for the given global experts, in order (the
    family spec's, torch-free: Spec.moe_layer_roles)."""
    return tables_for(cfg).spec.moe_layer_roles(experts)


fc_major = schema.fc_major  # an MoE layer's roles with the experts fc by fc (grouped linears; torch-free)


def rule_for(role: str, cfg: GPTConfig, column: Optional[str] = None) -> Rule:
    """A role's TP rule; column: the spec name column of the format, where its modules shard a role otherwise
    (Role.rules: Transformer Engine keeps MLA's down projections whole)."""
    _, role = scope_of(role)
    t = tables_for(cfg)
    rule = t.rules[role] if column is None else Rule(t.spec.roles[role].rule_in(column))
    return Rule.GATED if cfg.gated and t.spec.roles[role].fused == "halves" else rule


def spec_role(role: str) -> Tuple[str, Optional[int]]:
    """(the spec's role, global expert or None): ("experts.{expert}.fc1.weight", 3) for experts.3.fc1.weight."""
    m = MLP_SCOPES[0][0].match(role)
    return (f"experts.{{expert}}.{m.group(2)}", int(m.group(1))) if m else (role, None)


# --- fused layouts --------------------------------------------------------------------------

def unfuse_qkv(t: torch.Tensor, cfg: GPTConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped rows [ng, nq/ng + 2, hd, ...] -> q [nq*hd, ...], k [ng*hd, ...], v [ng*hd, ...]."""
    ng, per, hd = cfg.num_query_groups, cfg.heads_per_group, cfg.head_dim
    rest = t.shape[1:]
    g = t.reshape(ng, per + 2, hd, *rest)
    q = g[:, :per].reshape(ng * per * hd, *rest)
    k = g[:, per].reshape(ng * hd, *rest)
    v = g[:, per + 1].reshape(ng * hd, *rest)
    return q, k, v


def qkv_part(t: torch.Tensor, cfg: GPTConfig, index: int) -> torch.Tensor:
    """unfuse_qkv(t, cfg)[index], copying only that part (q, k and v load separately)."""
    ng, per, hd = cfg.num_query_groups, cfg.heads_per_group, cfg.head_dim
    rest = t.shape[1:]
    g = t.reshape(ng, per + 2, hd, *rest)
    rows = (slice(None, per), per, per + 1)[index]
    return g[:, rows].reshape(-1, *rest)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    ng, per, hd = cfg.num_query_groups, cfg.heads_per_group, cfg.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, per, hd, *rest), k.reshape(ng, 1, hd, *rest),
                         v.reshape(ng, 1, hd, *rest)], dim=1)
    return grouped.reshape(ng * (per + 2) * hd, *rest)


def qkv_rows(cfg: GPTConfig) -> int:
    return (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim


# --- readers: role shards -> canonical ------------------------------------------------------

def assemble(cfg: GPTConfig, shards: Dict[Tuple[str, Optional[int]], List[LazyTensor]],
             replicas: Optional[ReplicaPolicy] = None, column: Optional[str] = None) -> Dict[str, LazyTensor]:
    """Turn {(role, global_layer or None): [per-TP-rank lazy]} into canonical lazy tensors (column: the
    format's spec name column, for its TP rules: rule_for)."""
    out: Dict[str, LazyTensor] = {}
    t = tables_for(cfg)
    for (role, layer), parts in shards.items():
        name = t.global_roles[role] if layer is None else f"layers.{layer}.{role}"
        merged = merge_lazy(parts, rule_for(role, cfg, column), name, replicas)
        if layer is None:
            out[t.global_roles[role]] = merged
            continue
        mlp, base = scope_of(role)
        fused = _fused(t.spec, base)
        if base in t.layer_simple:
            out[f"layers.{layer}." + t.layer_simple[base].replace("mlp.", mlp, 1)] = merged
        elif fused in _UNFUSE:  # the parts, in fused order, as the spec names them
            names = tuple(canonical_names(role, layer, cfg))
            if not names:  # QKV in an MLA model, a dense fc1 in an MoE layer: the files and the config disagree
                raise CkptError(f"layer {layer}: a {role} tensor is stored, which a model with this config does not have",
                                "the checkpoint's args do not describe it (or pass the right flags)")
            out.update(_UNFUSE[fused](merged, cfg, layer, names))
        else:  # pragma: no cover - table and code disagree
            raise CkptError(f"internal: no canonical mapping for role {base}")
    return out


def _fused(spec: Spec, base: str) -> Optional[str]:
    """How a base role's tensor fuses its canonical parts (the spec's Role.fused), None when it does not."""
    role = spec.roles.get(base)
    return None if role is None else role.fused


def _unfuse_qkv(merged: LazyTensor, cfg: GPTConfig, layer: int, names) -> Dict[str, LazyTensor]:
    """A merged grouped QKV -> q, k, v, each declaring itself part of it (a writer re-fuses nothing)."""
    if merged.shape[0] != qkv_rows(cfg):
        raise CkptError(f"layer {layer}: fused QKV has {merged.shape[0]} rows, expected "
                        f"{qkv_rows(cfg)} for {cfg.num_attention_heads} heads, "
                        f"{cfg.num_query_groups} query groups, head size {cfg.head_dim}",
                        "check --num-attention-heads / --num-query-groups")
    out = {}
    for idx, name in enumerate(names):
        piece = Derived(lambda t, i=idx: qkv_part(t, cfg, i), [merged])
        out[name] = _declare_part(piece, merged, names, idx, qkv_blocks(cfg, idx))
    return out


def _unfuse_halves(merged: LazyTensor, cfg: GPTConfig, layer: int, names) -> Dict[str, LazyTensor]:
    """A merged fc1 -> [gate; up] halves of a gated MLP, each declaring itself part of it; up alone otherwise
    (the spec's parts for the config say which)."""
    if len(names) == 1:
        return {names[0]: merged}
    half = merged.shape[0] // len(names)
    return {name: _declare_part(merged.narrow(0, idx * half, half), merged, names, idx, ((idx * half, half),))
            for idx, name in enumerate(names)}


# Role.fused -> how assemble() cuts a merged fused tensor into its canonical parts
_UNFUSE = {"qkv": _unfuse_qkv, "halves": _unfuse_halves}


def _declare_part(piece: LazyTensor, fused: LazyTensor, names, index: int, blocks) -> LazyTensor:
    """piece (made here, so no one else holds it) declares itself part `index` of the fused tensor, so a
    writer that fuses the same parts again takes the fused tensor as it is (a merge writes fc1/QKV
    without re-fusing)."""
    piece.placement = Placement(fused, tuple(names), tuple(blocks), 0, index)
    return piece


def qkv_blocks(cfg: GPTConfig, index: int) -> Tuple[Tuple[int, int], ...]:
    """The rows of q (index 0), k (1) or v (2) in the grouped QKV: one (offset, length) per query group."""
    per, hd = cfg.heads_per_group, cfg.head_dim
    first, length = ((0, per * hd), (per * hd, hd), ((per + 1) * hd, hd))[index]
    return tuple((g * (per + 2) * hd + first, length) for g in range(cfg.num_query_groups))


def _fused_whole(parts) -> Optional[LazyTensor]:
    """The fused tensor parts came from, when they declare themselves all of its parts in order; else None."""
    first = parts[0].placement
    if first is None or first.part is None:
        return None
    if all(p.placement is not None and p.placement.is_part(first.whole, i) for i, p in enumerate(parts)):
        return first.whole
    return None


# --- writers: canonical -> role tensors -----------------------------------------------------

def layer_role_tensor(tensors: Dict[str, LazyTensor], cfg: GPTConfig, layer: int,
                      role: str) -> Optional[LazyTensor]:
    """The merged (TP=1) fused tensor for one layer role, or None when the model lacks it."""
    scoped = role
    mlp, role = scope_of(role)
    t = tables_for(cfg)
    if role in t.layer_simple:
        if not t.spec.has_role(spec_role(scoped)[0], cfg, layer):  # MLA's direct q has GQA's q name
            return None
        return tensors.get(f"layers.{layer}." + t.layer_simple[role].replace("mlp.", mlp, 1))
    fused = _fused(t.spec, role)
    if fused not in _FUSE:
        raise CkptError(f"internal: unknown role {role}")
    kind = role.partition(".")[2] or "tensors"  # weight / bias, for the messages
    return _FUSE[fused](cfg, layer, kind, [tensors.get(n) for n in canonical_names(scoped, layer, cfg)])


def _fuse_qkv(cfg: GPTConfig, layer: int, kind: str, parts) -> Optional[LazyTensor]:
    """q, k, v -> the grouped QKV: the one they were cut from when they declare it, else fused (memoised)."""
    if all(x is None for x in parts):
        return None
    if any(x is None for x in parts) or len(parts) != 3:  # (an MLA model has q alone)
        raise CkptError(f"layer {layer}: q, k and v {kind} must all be present or all absent")
    same = _fused_whole(parts)
    if same is not None and same.shape[0] == qkv_rows(cfg):
        return same
    return Derived(lambda q, k, v: fuse_qkv(q, k, v, cfg), parts, memo=True,
                   shape=cat_shape([p.shape for p in parts]), dtype=parts[0].dtype)


def _fuse_halves(cfg: GPTConfig, layer: int, kind: str, parts) -> Optional[LazyTensor]:
    """gate, up -> fc1 = [gate; up] of a gated MLP (the one they were cut from when they declare it); up
    alone otherwise (the spec's parts for the config say which)."""
    if len(parts) == 1:
        return parts[0]
    if all(x is None for x in parts):
        return None
    if any(x is None for x in parts):
        raise CkptError(f"layer {layer}: a gated MLP needs both gate and up {kind}")
    return _fused_whole(parts) or cat(parts, 0, memo=True)


# Role.fused -> how a writer gets a fused role's merged tensor from its canonical parts
_FUSE = {"qkv": _fuse_qkv, "halves": _fuse_halves}


def canonical_names(role: str, layer: Optional[int], cfg: GPTConfig) -> List[str]:
    """The canonical tensors a role's tensor holds (one, or the fused parts of QKV and gated fc1), from the spec."""
    t = tables_for(cfg)
    if layer is None:  # a role without a tensor of its own (the head copy) holds the tied embedding again
        return [t.global_roles.get(role) or t.tied_embedding]
    name, expert = spec_role(role)
    return [p.format(layer, expert) for p in t.spec.parts(name, cfg, layer)]


def global_role_tensor(tensors: Dict[str, LazyTensor], role: str) -> Optional[LazyTensor]:
    return tensors.get(GLOBAL_ROLES[role])


def shard_role(tensor: LazyTensor, role: str, cfg: GPTConfig, tp: int, layer: Optional[int] = None,
               names: Optional[Tuple[str, ...]] = None, column: Optional[str] = None) -> List[LazyTensor]:
    """The tp per-rank pieces of a role tensor (layer's, or a global one), each declaring its placement
    under the role's canonical names (or `names` where the caller knows better: a head copy); column: the
    format's spec name column, for its TP rules (rule_for)."""
    return split_lazy(tensor, rule_for(role, cfg, column), tp, names or canonical_names(role, layer, cfg))
