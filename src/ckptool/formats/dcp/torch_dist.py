"""megatron-core `torch_dist` checkpoints and plain torch.distributed.checkpoint (DCP) directories.

Facts (shared/reference/megatron.md section 8): an iteration directory holds metadata.json
({"sharded_backend": "torch_dist", ...}), the DCP index `.metadata`, data files `__R_N.distcp`, and
the non-sharded "common" state (args, checkpoint_version, iteration) in `common.pt` or, since
Megatron-LM #5160, as the byte entry `common_state/shard_0_1` (torch.save([state])) inside the DCP.
Tensors are stored with GLOBAL shapes, already TP-merged: QKV in grouped order, SwiGLU fc1 as
[all gate; all up]. Homogeneous layers are stacked on a leading axis (`decoder.layers.<name>`,
[L, ...]); other models use `decoder.layers.{i}.<name>`. Norms use Transformer-Engine names even
for local layers, except in Multi-Latent Attention layers, which the local spec saves under their modules'
own names (q_layernorm is then the q latent norm; MLA_WRITE_NAMES). A plain DCP save of a model's sharded_state_dict (megatron-core's simple training
loop) has the same keys, possibly under `model.` / `model.module.`, and stores no args.

MoE (megatron-core transformer/moe/experts.py, the same form for SequentialMLP, GroupedMLP and TEGroupedMLP):
router and shared expert are per-layer tensors like the dense ones; a layer's experts are ONE tensor with
the global expert index as an axis in front of the weight's own (`mlp.experts.experts.linear_fc1.weight`
[E, out, in], GLU fc1 per expert as [gate; up]). Layers are keyed by index instead of stacked when
--moe-layer-freq is a list or above 1 (transformer_block.py), and with the singleton_local_shards metadata,
which also gives each expert its own keys (`mlp.experts.experts.{e}.linear_fc1.weight_w` / `_v`: GLU halves);
both are read, the stacked / per-layer form megatron-core asks for by default is written.

The reader never imports Megatron and needs no process group (io/dcp_io.py reads the chunks).
The writer produces one stacked, full-shape chunk per layer (per layer and expert for experts, so one
expert is in memory at a time): megatron-core reshards on load, so the same files load at any TP/PP/EP.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...config import GPTConfig, Layout, check_tensor_parallel
from ...errors import CkptError, require
from ...io.dcp_io import DcpDir, DcpWriter
from ...io.torchfile import load_torch_bytes, load_torch_file, save_streaming
from ...lazy import LazyTensor, cat, load_scope
from ...options import CONFIG_OVERRIDES, ReadOptions
from ...roles import LAYER_ROLES, assemble, is_parameter, expert_role, global_role_tensor, layer_role_tensor
from ...sharding import ReplicaPolicy
from ...spec import GPT
from ...spec.schema import DIST, MCORE, TE_MLA, TE_MOE
from ...state import WEIGHT, Checkpoint, OptimizerState, SourceInfo, expected_names, in_model_order
from ...summary import WriteSummary
from ...vocab import with_true_vocab_size
from ...write_options import WriteOptions
from . import (optim as dist_optim, optim_buckets as dist_optim_buckets, optim_flattened as dist_optim_flattened,
               optim_fsdp_dtensor, sidecars)
from ..megatron import args as megatron_args, buffers as megatron_buffers
from .files import COMMON_FILE, COMMON_KEY, CONFIG_FILE, DCP_COMMON_KEYS, locate, looks_like  # noqa: F401 (looks_like: the table's)
from ..megatron.checkpoint import TRACKER, MegatronArgs, MegatronPlan, plan_megatron
from ..megatron.names import DIALECTS, global_layer, is_mla, mtp_local
from ..megatron.optim import GroupRule
from ..registry import open_checkpoint

FORMAT = "torch_dist"

# Names from the spec (spec/gpt.py): torch_dist keys are megatron-core's with Transformer-Engine norm names even
# for local layers (the spec's "dist" column). GLOBAL_KEYS / LAYER_KEYS: key -> role (read); WRITE_NAMES: what we write.
GLOBAL_KEYS = {key: role for role, key in GPT.keys("global", DIST).items()}
WRITE_NAMES = GPT.keys("layer", DIST)
LAYER_KEYS = {v: k for k, v in WRITE_NAMES.items()}
# Local-spec names, found in plain DCP saves of model.state_dict() (not sharded_state_dict()).
LAYER_KEYS.update({key: role for role, key in GPT.keys("layer", MCORE).items() if key not in LAYER_KEYS})
# MoE layers (megatron-core SequentialMLP / GroupedMLP / TEGroupedMLP, which share one sharded form): router and
# shared expert per layer like the dense roles; every expert of a layer in ONE tensor with an expert axis
# before the weight's own axes ([E, out, in]; [L, E, out, in] when stacked), global expert index = position on it.
MOE_WRITE_NAMES = GPT.keys("moe", DIST)
EXPERT_WRITE_NAMES = {GPT.roles[role].base: key for role, key in GPT.keys("expert", DIST).items()}
LAYER_KEYS.update({v: k for k, v in MOE_WRITE_NAMES.items()})
EXPERT_KEYS = {v: k for k, v in EXPERT_WRITE_NAMES.items()}
# The MLP norm of an MoE layer has no fc1 to fuse into. megatron-core's local spec maps its key onto the dense
# name (sharded_state_dict_keys_map); the Transformer Engine spec keeps the module's own name (gpt_layer_specs.py;
# not run here: no Transformer Engine). Both are read (LAYER_KEYS); the target args' transformer_impl picks.
MOE_NORM_NAMES = {"transformer_engine": GPT.keys("layer", TE_MOE), "local": {}}
# Multi-Latent Attention layers (megatron-core gpt_layer_specs.py) are saved under their modules' own names: the local
# spec maps no keys for them (its q_layernorm / kv_layernorm / input_layernorm / pre_mlp_layernorm stay), the TE spec
# keeps input_layernorm a module of its own and the latent norms inside the up projections (layer_norm_weight; not
# run here: no Transformer Engine). The target args' transformer_impl picks the names written; an MLA model's keys
# are read with MLA_LAYER_KEYS, where q_layernorm is the q latent norm (GQA's q norm elsewhere).
MLA_WRITE_NAMES = {"local": GPT.keys("layer", MCORE), "transformer_engine": GPT.keys("layer", TE_MLA)}
MLA_LAYER_KEYS = {**LAYER_KEYS, **{key: role for names in MLA_WRITE_NAMES.values() for role, key in names.items()
                                   if role.startswith("mla.") or key not in LAYER_KEYS}}
# Roles written in their stored dtype whatever --dtype says: megatron-core keeps the expert bias in float32
# (router.py _maintain_float32_expert_bias), whatever the model's dtype.
KEEP_STORED_DTYPE = ("router.expert_bias",)
# With the sharded_state_dict metadata singleton_local_shards (read only), every layer is keyed by its index,
# each expert has its own keys (group 1 the global expert, group 2 an EXPERT_KEYS name without the prefix)...
SINGLETON_EXPERT = re.compile(r"^mlp\.experts\.experts\.(\d+)\.(linear_fc[12]\.weight)$")
# ...and a GLU fc1 (dense, shared or expert) is stored as its gate and up halves under these suffixes.
GLU_HALVES = {"_w": 0, "_v": 1}
# --- Megatron-FSDP fsdp_dtensor experts (issue 31) ---
# Megatron-LM's --ckpt-format fsdp_dtensor saves model.state_dict() names per layer, experts by their GLOBAL index
# (megatron-core 0.16.1 transformer/fsdp_dtensor_checkpoint.py handle_experts_in_state_dict): Transformer Engine's
# grouped experts as `mlp.experts.linear_fc1.weight{e}` (what Megatron-LM d98e8a64 tools/checkpoint/
# checkpoint_inspector.py split_expert_weights writes), SequentialMLP's as `mlp.experts.local_experts.{e}.linear_fc1.
# weight`; a GLU fc1 of either split into `_w` / `_v` halves after the index (handle_swiglu_in_state_dict).
# Group 1/2: fc and weight|bias of the grouped name with group 3 its expert; groups 4-6 the same of SequentialMLP's.
FSDP_EXPERT = re.compile(r"^mlp\.experts\.(?:linear_(fc[12])\.(weight|bias)(\d+)|local_experts\.(\d+)\.linear_(fc[12])\."
                         r"(weight|bias))$")
# Stored MoE forms ckptool does not read, by what they are (refused with these words, never skipped).
NOT_READ = (
    (re.compile(r"^mtp\."), "multi-token-prediction (MTP) tensors of a form ckptool does not know",
     "ckptool reads megatron-core's MTP block (mtp.layers.{k}.enorm / hnorm / eh_proj / final_layernorm and its "
     "transformer_layer.*), and never converts a model with parts left out"),
    (re.compile(r"mlp\.experts\."), "an expert layout other than megatron-core's sharded experts",
     "ckptool reads experts stored as decoder.layers[.N].mlp.experts.experts.linear_fc{1,2}.weight "
     "[(layers,) experts, out, in] or one key per expert (...experts.experts.{e}.linear_fc1.weight_w / _v; "
     "Megatron-FSDP's ...experts.linear_fc1.weight{e} / ...experts.local_experts.{e}.linear_fc1.weight)"),
)


def _modules(*roles: str) -> tuple:
    """The modules holding these roles' torch_dist keys (a ShardedObject per linear module)."""
    return tuple(GPT.roles[r].key(DIST).rsplit(".", 1)[0] for r in roles)


# ShardedObjects megatron-core expects per layer (local spec: 4, TE spec adds core_attention, which holds no weight);
# an MLA layer has its q / kv linears' (those of the roles it holds) in place of linear_qkv's.
EXTRA_STATE = _modules("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight") + ("self_attention.core_attention",)
MLA_LINEARS = ("mla.q.weight", "mla.q_down.weight", "mla.q_up.weight", "mla.kv_down.weight", "mla.kv_up.weight")
SHARED_EXTRA_STATE = _modules("shared.fc1.weight", "shared.fc2.weight")
EXPERT_EXTRA_STATE = _modules("experts.{expert}.fc1.weight", "experts.{expert}.fc2.weight")  # one per expert
# A ShardedObject is stored as torch.save([its data]); local layers' extra state is None. megatron-core
# asks for these objects at load, so they are written even though they hold nothing.
_buf = io.BytesIO()
torch.save([None], _buf)
NO_EXTRA_STATE = _buf.getvalue()
del _buf
MODEL_PREFIXES = ("model.module.module.", "model.module.", "model.", "module.", "")
# Entries that are not model weights: skipped.
SKIP = re.compile(r"(_extra_state|^rng_state|^(chained_\d+\.)?optimizer\.|^common_state|rerun_state_machine)")
PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# --- multi-token prediction (MTP): megatron-core's MTP block, each MTP layer under its own keys (no layer axis:
# MultiTokenPredictionBlock.sharded_state_dict gives its layers no layer offset), its decoder layer's keys as a
# per-layer decoder layer's under MTP_PREFIX + GPT.mtp.inner, its experts [E, out, in] (megatron-core 0.16.1)
MTP_LAYER = re.compile("(?:^|[.])" + re.escape(GPT.mtp_prefix(DIST)).replace(r"\{i\}", r"(\d+)") + "(.+)$")
MTP_WRITE_NAMES = GPT.keys("mtp", DIST)
MTP_KEYS = {v: k for k, v in MTP_WRITE_NAMES.items()}
STACKED = re.compile(r"^decoder\.layers\.(.+)$")


# --- locating -------------------------------------------------------------------------------

def _backend(d: Path) -> Optional[str]:
    f = d / CONFIG_FILE
    if not f.is_file():
        return None  # plain DCP (torch_dcp / fsdp_dtensor / a bare dist_checkpointing save)
    try:
        cfg = json.loads(f.read_text())
    except (ValueError, OSError) as e:
        raise CkptError(f"{f}: not valid JSON ({e})", "the checkpoint is corrupt")
    backend = cfg.get("sharded_backend") if isinstance(cfg, dict) else None
    if backend == "zarr":
        raise CkptError(f"{d}: a megatron-core checkpoint in the legacy zarr backend, which ckptool does "
                        "not read", "re-save it as torch_dist with megatron-core <= 0.14 "
                        "(tools/checkpoint/convert.py or --ckpt-convert-format torch_dist)")
    if backend not in ("torch_dist", "torch"):
        raise CkptError(f"{f}: unknown sharded_backend {backend!r}", "ckptool reads torch_dist checkpoints")
    return backend


def read_common_state(d: Path, dcp: DcpDir) -> dict:
    """The non-sharded state: common.pt (older), the in-DCP common_state entry (newer), or Megatron-LM's
    torch_dcp / fsdp_dtensor byte entries (files.DCP_COMMON_KEYS)."""
    if (d / COMMON_FILE).is_file():
        state = load_torch_file(d / COMMON_FILE)
    elif COMMON_KEY in dcp.entries:
        state = load_torch_bytes(dcp.read_bytes(COMMON_KEY), source=f"{d.name}:{COMMON_KEY}")
        if isinstance(state, (list, tuple)) and len(state) == 1:
            state = state[0]
    else:  # torch_dcp / fsdp_dtensor: each common entry a byte entry of its own
        state = {k: load_torch_bytes(dcp.read_bytes(k), source=f"{d.name}:{k}") for k in DCP_COMMON_KEYS
                 if k in dcp.entries and not hasattr(dcp.entries[k], "chunks")}
    return state if isinstance(state, dict) else {}


# --- reading --------------------------------------------------------------------------------

def _model_prefix(keys: List[str]) -> str:
    for p in MODEL_PREFIXES:
        if any(k.startswith(p) and k[len(p):] == "embedding.word_embeddings.weight" for k in keys):
            return p
    sample = ", ".join(sorted(keys)[:4])
    raise CkptError(f"no word embedding (embedding.word_embeddings.weight) among the DCP tensors "
                    f"(e.g. {sample})", "ckptool reads megatron-core GPT models saved with "
                    "dist_checkpointing or torch.distributed.checkpoint, and FSDP / torchtitan DCP saves of the "
                    "Hugging Face GPT families it converts")


def _collect(dcp: DcpDir, slot_prefix: Optional[str] = None) -> Tuple[Dict[Tuple[str, Optional[int]], List[LazyTensor]], bool]:
    """{(role, global layer or None): [lazy]} and whether layers were stacked. slot_prefix: read the
    optimizer tensors stored under that prefix + the model key (dcp/optim.py) instead of the weights."""
    keys = dcp.tensor_keys()
    prefix = _model_prefix(keys) if slot_prefix is None else slot_prefix
    table = MLA_LAYER_KEYS if is_mla(keys) else LAYER_KEYS  # one key, q_layernorm, names a role by model
    shards: Dict[Tuple[str, Optional[int]], List[LazyTensor]] = {}
    unknown, stacked = [], False
    halves: Dict[Tuple[str, int], Dict[int, LazyTensor]] = {}
    for key in keys:
        if not key.startswith(prefix):
            continue
        k = key[len(prefix):]
        if SKIP.search(key if slot_prefix is None else k):
            continue
        if k in GLOBAL_KEYS:
            shards[(GLOBAL_KEYS[k], None)] = [dcp.lazy(key)]
            continue
        m = MTP_LAYER.match(k)
        if m and _add_mtp(shards, dcp, key, int(m.group(1)), m.group(2), table):
            continue
        m = PER_LAYER.match(k)
        role = _layer_role(m.group(2), table) if m else None
        if role:
            shards[(role, int(m.group(1)))] = [dcp.lazy(key)]
            continue
        if m and m.group(2) in EXPERT_KEYS:
            _add_experts(shards, dcp, key, EXPERT_KEYS[m.group(2)], [int(m.group(1))], stacked=False)
            continue
        half = GLU_HALVES.get(m.group(2)[-2:]) if m else None
        role = _layer_role(m.group(2)[:-2], table) if half is not None else None
        if role and role.endswith("fc1.weight"):
            halves.setdefault((role, int(m.group(1))), {})[half] = dcp.lazy(key)
            continue
        m = STACKED.match(k)
        if m and m.group(1) in table:
            stacked = True
            size = tuple(dcp.entries[key].size)
            for i in _stored_layers(dcp, key):
                shards[(table[m.group(1)], i)] = [dcp.lazy(key, (i,), (1,) + size[1:], squeeze=1)]
            continue
        if m and m.group(1) in EXPERT_KEYS:
            stacked = True
            _add_experts(shards, dcp, key, EXPERT_KEYS[m.group(1)], _stored_layers(dcp, key), stacked=True)
            continue
        unknown.append(key)
    if unknown:
        _refuse_unknown(unknown)
    for (role, i), parts in halves.items():  # gate and up of a GLU fc1 again as megatron-core's [gate; up]
        require(len(parts) == 2, f"layer {i}: {role} has only its {'gate' if 0 in parts else 'up'} half "
                "(weight_w / weight_v) stored", "the checkpoint is incomplete")
        shards[(role, i)] = [cat([parts[0], parts[1]], 0)]
    return shards, stacked


def _add_mtp(shards, dcp: DcpDir, key: str, k: int, rest: str, table: Dict[str, str]) -> bool:
    """MTP layer k's tensor (its own role, or its decoder layer's, experts included) into shards at the local layer
    mtp_local(k) (place_mtp_layers numbers it after the decoder's); False when the name is none of these."""
    inner = GPT.mtp.inner
    role = MTP_KEYS.get(rest) or (_layer_role(rest[len(inner):], table) if rest.startswith(inner) else None)
    if role:
        shards[(role, mtp_local(k))] = [dcp.lazy(key)]
        return True
    if rest.startswith(inner) and rest[len(inner):] in EXPERT_KEYS:
        _add_experts(shards, dcp, key, EXPERT_KEYS[rest[len(inner):]], [mtp_local(k)], stacked=False)
        return True
    return False


def _check_mtp_declared(shards, cfg: GPTConfig, dcp: DcpDir, cfg_src: str) -> None:
    """The MTP layers stored are the ones the config declares (--mtp-num-layers), refused by name otherwise."""
    held = len({layer for _, layer in shards if layer is not None and layer >= cfg.num_layers})
    if held != cfg.mtp_num_layers:
        example = next((k for k in dcp.tensor_keys() if MTP_LAYER.search(k)), "no mtp.layers.* key")
        raise CkptError(f"multi-token-prediction (MTP) layers: {cfg_src} declare {cfg.mtp_num_layers} "
                        f"(--mtp-num-layers), the checkpoint holds {held} (e.g. {example})",
                        "the args do not describe the checkpoint; convert the one its run saved")


def place_mtp_layers(shards, num_layers: int):
    """shards with MTP layer k (local layer mtp_local(k)) at global layer num_layers + k."""
    return {(role, global_layer(layer, 0, num_layers)): v for (role, layer), v in shards.items()}


def _layer_role(name: str, table: Dict[str, str]) -> Optional[str]:
    """The role of a layer-relative stored name (one tensor, no expert axis) in table (LAYER_KEYS, or
    MLA_LAYER_KEYS for an MLA model), or None."""
    if name in table:
        return table[name]
    m = SINGLETON_EXPERT.match(name)
    if m:
        return expert_role(int(m.group(1)), EXPERT_KEYS[f"mlp.experts.experts.{m.group(2)}"])
    m = FSDP_EXPERT.match(name)
    if m is None:
        return None
    fc, kind, e = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(5), m.group(6), m.group(4))
    return expert_role(int(e), EXPERT_KEYS[f"mlp.experts.experts.linear_{fc}.{kind}"])


def _stored_layers(dcp: DcpDir, key: str) -> List[int]:
    """The layers a stacked tensor holds chunks for (all of them in a homogeneous model)."""
    return sorted({i for c in dcp.entries[key].chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])})


def _add_experts(shards, dcp: DcpDir, key: str, base: str, layers: List[int], stacked: bool) -> None:
    """Every expert of an experts tensor as role experts.{e}.<base> of each of layers ([E, out, in] of one
    layer, or [L, E, out, in] with the layer axis first when stacked)."""
    size = tuple(dcp.entries[key].size)
    lead = 2 if stacked else 1
    own = (", out" if base.endswith("bias") else ", out, in")  # GPT-OSS: expert biases [(layers,) experts, out]
    require(len(size) == lead + own.count(","),
            f"{key}: shape {size} is not [{'layers, ' if stacked else ''}experts{own}]",
            "ckptool reads megatron-core's stacked experts")
    for i in layers:
        for e in range(size[lead - 1]):
            at = (i, e) if stacked else (e,)
            shards[(expert_role(e, base), i)] = [dcp.lazy(key, at, (1,) * lead + size[lead:], squeeze=lead)]


def _refuse_unknown(keys: List[str]) -> None:
    for pattern, what, hint in NOT_READ:
        hits = sorted(k for k in keys if pattern.search(k))
        if hits:
            raise CkptError(f"{what}: {len(hits)} tensors such as {hits[0]}, which ckptool does not read", hint)
    raise CkptError(f"{len(keys)} tensors are not part of a megatron-core GPT model "
                    f"(e.g. {', '.join(sorted(keys)[:3])})",
                    "ckptool converts GPT models, dense or MoE, with grouped-query or Multi-Latent Attention "
                    "(no hybrid layers)")


def config_from_shapes(shards, num_layers: int, stored_rows: int, ov: dict, warn) -> GPTConfig:
    """No args stored (a bare dist_checkpointing.save): sizes from shapes, the rest from flags."""
    hidden = shards[("word", None)][0].shape[1]
    if any(role.startswith("mla.") for role, _ in shards):
        raise CkptError("a Multi-Latent Attention model that stores no args (a bare dist_checkpointing save): its "
                        "head sizes (nope / rope / v) cannot be read from tensor shapes",
                        "give --args-from A_CHECKPOINT_OF_THE_SAME_RUN")
    heads = ov.get("num_attention_heads")
    if not heads:
        raise CkptError("this checkpoint stores no args (a bare dist_checkpointing/DCP save) and has no config "
                        "sidecar, and the number of attention heads cannot be read from tensor shapes",
                        "give --hf-config DIR (the model's config.json), --num-attention-heads N (and "
                        "--num-query-groups for GQA), or --args-from A_CHECKPOINT_OF_THE_SAME_RUN (sidecars looked "
                        f"for: {sidecars.names()})")
    head_dim = ov.get("head_dim") or hidden // heads
    qkv = shards.get(("qkv.weight", 0))
    groups = ov.get("num_query_groups")
    if groups is None and qkv is not None:
        groups = (qkv[0].shape[0] // head_dim - heads) // 2
    fc2 = shards.get(("fc2.weight", 0))
    fc1 = shards.get(("fc1.weight", 0))
    ffn = fc2[0].shape[1] if fc2 else 4 * hidden
    gated = bool(fc1) and fc1[0].shape[0] == 2 * ffn
    activation = ov.get("activation") or ("swiglu" if gated else "gelu")
    if not ov.get("activation") and not gated:
        warn("no args stored: assuming exact (erf) GeLU; pass --activation gelu_tanh if the model used "
             "the tanh approximation")
    pos = shards.get(("pos", None))
    if not pos and not ov.get("position_embedding"):
        warn("no args stored and no position embedding table: assuming rotary positions with base "
             f"{ov.get('rotary_base', 10000)}")
    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
              head_dim=head_dim, ffn_hidden_size=ffn, padded_vocab_size=stored_rows,
              max_position_embeddings=pos[0].shape[0] if pos else ov.get("max_position_embeddings", 0),
              position_embedding="learned" if pos else "rope",
              normalization="layernorm" if ("attn_norm.bias", 0) in shards else "rmsnorm",
              activation=activation, add_bias_linear=("proj.bias", 0) in shards,
              add_qkv_bias=("qkv.bias", 0) in shards,
              qk_layernorm=("q_norm.weight", 0) in shards,
              tied_embeddings=("output", None) not in shards)
    kw.update({k: v for k, v in ov.items() if k in CONFIG_OVERRIDES})
    return GPTConfig(**kw)


def _args_from(path: str):
    """args (or a config) of another checkpoint of the same run, for --args-from."""
    other = open_checkpoint(path, ReadOptions())
    return other.source.args, other.config


def _source_config(d: Path, common: dict, shards, num_layers: int, stored_rows: int, opts: ReadOptions,
                   warnings: List[str]):
    """(config, args, where the config came from, the sidecar read or None): the common state's args, else
    --args-from's, else the config sidecar its trainer wrote (dcp/sidecars.py: Megatron-Bridge, NeMo 2, verl) or
    --hf-config, else tensor shapes and flags."""
    ov = {k: v for k, v in opts.overrides.items() if v is not None}
    args, cfg, sidecar = common.get("args"), None, None
    cfg_src = "the checkpoint's args"
    if args is None and opts.args_from:
        args, other_cfg = _args_from(opts.args_from)
        cfg_src = f"--args-from {opts.args_from}"
        if args is None:
            cfg = other_cfg.replace(padded_vocab_size=stored_rows, num_layers=num_layers)
    elif args is None:
        sidecar = sidecars.find(d, opts.hf_config)
        if sidecar is not None:
            args, cfg_src = sidecar.args, sidecar.what
            if sidecar.hf is not None:
                cfg = sidecar.config(stored_rows).replace(**opts.config_overrides())
    if args is not None:
        cfg = megatron_args.config_from_args(args, stored_rows)
        cfg = cfg.replace(**opts.config_overrides())
        cfg, note = megatron_args.as_megatron_core_computes(cfg)  # torch_dist is always megatron-core
        if note:
            warnings.append(note)
    elif cfg is None:
        cfg_src = "tensor shapes and flags"
        if any(role.startswith(("experts.", "router.")) for role, _ in shards):
            raise CkptError(f"{d}: an MoE model that stores no args (a bare dist_checkpointing save) and has no "
                            "config sidecar: the routing (top-k, score function) cannot be read from tensor shapes",
                            f"give --hf-config DIR (the model's config.json) or --args-from A_CHECKPOINT_OF_THE_SAME_RUN "
                            f"(sidecars looked for: {sidecars.names()})")
        cfg = config_from_shapes(shards, num_layers, stored_rows, ov, warnings.append)
    return cfg, args, cfg_src, sidecar


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    d, iteration, release = locate(Path(path), opts.iteration)
    backend = _backend(d)
    dcp = DcpDir(d)
    common = read_common_state(d, dcp)
    shards, stacked = _collect(dcp)
    layers = sorted({layer for _, layer in shards if layer is not None and layer >= 0})  # the decoder's, not MTP
    num_layers = layers[-1] + 1 if layers else 0
    shards = place_mtp_layers(shards, num_layers)
    missing = sorted(set(range(num_layers)) - set(layers))
    if missing:
        raise CkptError(f"{d}: layers {missing} have no tensors", "the checkpoint is incomplete")
    stored_rows = shards[("word", None)][0].shape[0]
    warnings: List[str] = []
    cfg, args, cfg_src, sidecar = _source_config(d, common, shards, num_layers, stored_rows, opts, warnings)
    ov = {k: v for k, v in opts.overrides.items() if v is not None}
    if ov.get("vocab_size"):
        cfg = cfg.replace(vocab_size=ov["vocab_size"], vocab_size_source="--vocab-size")
    cfg = with_true_vocab_size(cfg, opts.true_vocab_size, stored_rows)
    require(cfg.vocab_size is None or cfg.vocab_size <= stored_rows,
            f"the true vocabulary ({cfg.vocab_size}) exceeds the {stored_rows} embedding rows stored")
    require(cfg.num_layers == num_layers, f"{cfg_src} say {cfg.num_layers} layers but the checkpoint holds "
            f"{num_layers}", "the checkpoint is incomplete or its args are wrong")
    _check_mtp_declared(shards, cfg, dcp, cfg_src)
    if cfg.tied_embeddings:
        shards.pop(("output", None), None)  # a tied model's synchronised head copy
    policy = ReplicaPolicy(opts.replicas, warnings.append)
    tensors = assemble(cfg, shards, policy)
    _check_complete(tensors, cfg, d)
    tensors = in_model_order(tensors, cfg)
    info = SourceInfo(path=str(path), format=FORMAT,
                      dialect="mcore-dist" if stacked else "mcore-dist-per-layer",
                      layout=megatron_args.run_layout(args, cfg),
                      release=release, iteration=iteration if iteration is not None else common.get("iteration"),
                      checkpoint_version=common.get("checkpoint_version"), args=args,
                      extra={"replica_policy": policy, "plain_dcp": backend is None,
                             **({"hf_config": sidecar.hf, "config_sidecar": sidecar.what} if sidecar else {})})
    optimizer = _read_optimizer(dcp, common, cfg, tensors, policy, args, str(d), warnings) if opts.optimizer else None
    return Checkpoint(cfg, tensors, info, warnings, optimizer)


def _check_complete(tensors: Dict[str, LazyTensor], cfg: GPTConfig, where: Path) -> None:
    """Every tensor the config implies is there, nothing else is, and experts have the expert shapes: an
    expert layout read wrongly must fail here, not leave experts out of (or misshapen in) the output."""
    want = expected_names(cfg)
    missing = [n for n in want if n not in tensors]
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise CkptError(f"{where}: " + "; ".join(f"{len(names)} tensors {what} (e.g. {', '.join(names[:3])})"
                                                 for names, what in ((missing, "missing"), (extra, "not in the model its "
                                                 "args describe")) if names),
                        "the checkpoint is incomplete, or its args do not describe it")
    moe = cfg.moe
    if moe is None:
        return
    h, f = cfg.hidden_size, moe.ffn_hidden_size
    for i in moe.layers:
        for e in range(moe.num_experts):
            p = f"layers.{i}.mlp.experts.{e}."
            for name, shape in ((p + "up.weight", (f, h)), (p + "down.weight", (h, f))):
                got = tuple(tensors[name].shape)
                require(got == shape, f"{where}: {name} has shape {got}, expected {shape} ({moe.num_experts} experts "
                        f"of FFN size {f}, hidden {h})", "the checkpoint's args do not describe its experts")


def _read_optimizer(dcp: DcpDir, common: dict, cfg: GPTConfig, tensors, policy, args, where: str,
                    warnings: List[str]) -> Optional[OptimizerState]:
    """The optimizer state of a model-space form as slots (dcp/optim.py); other forms are dropped
    with a warning naming them (the weights are still converted)."""
    if optim_fsdp_dtensor.holds(dcp):  # Megatron-FSDP's: per parameter, no optimizer entry in the common state
        params = {n: w for n, w in tensors.items() if is_parameter(n)}
        return optim_fsdp_dtensor.read(dcp, params, lambda v: _slot_canonical(v, cfg, policy), where, warnings.append)
    common = _lightning_unwrapped(common)
    ep = (getattr(args, "expert_model_parallel_size", None) or 1) if cfg.moe is not None else 1
    chain = dist_optim.unsupported_chain(common, ep)
    if chain:
        warnings.append(f"optimizer state dropped: {chain} is not carried (megatron-core chains [dense, expert] "
                        "at EP > 1 only); the output holds the weights only")
        return None
    form = dist_optim.sharding_type(common)
    if form is None:
        if any(SKIP.search(k) and "optimizer." in k for k in dcp.entries):
            warnings.append("optimizer state dropped: the checkpoint holds optimizer tensors but no optimizer "
                            "entry in its common state (a bare save); the output holds the weights only")
        return None
    why = dist_optim.NOT_MODEL_SPACE.get(form)
    if form in dist_optim.BUFFER_FORMS:
        why = megatron_buffers.unsupported(args)
        why = why and f"flat per-bucket buffers whose layout ckptool recomputes only without {why}"
    if why:
        warnings.append(f"optimizer state dropped: the distributed optimizer's {form} form ({why}) is not "
                        "carried yet; the output holds the weights only (re-save with "
                        "--dist-ckpt-optim-fully-reshardable to carry it)")
        return None
    consumed = getattr(args, "consumed_train_samples", None)
    rule = GroupRule.from_args(args)
    if form in dist_optim.BUFFER_FORMS:
        # MoE at EP > 1: the [dense, expert] chain, each optimizer's buffers under its chained_N. prefix
        flat = dist_optim_buckets.read_shards(dcp, tensors, cfg, args, where, form)
        by_stored = {dist_optim_buckets.STORED[slot]: shards for slot, shards in flat.items()}
        scalars = dist_optim_buckets.read_scalars(dcp, common, where, megatron_buffers.parts(cfg, ep))
        column = megatron_buffers.rule_column(getattr(args, "transformer_impl", "transformer_engine"))
        return dist_optim.read(scalars, form,
                               lambda stored: in_model_order(assemble(cfg, by_stored[stored], policy, column), cfg),
                               tensors, consumed, where, rule, ep)
    if form not in dist_optim.STORED_SLOTS:
        raise CkptError(f"{where}: unknown optimizer form {form!r}", dist_optim.HINT)
    weight_shards = place_mtp_layers(_collect(dcp)[0], cfg.num_layers)
    model_prefix = _model_prefix(dcp.tensor_keys())  # NeMo 2: `module.`, inside each optimizer key too

    def slot_tensors(stored: str):
        prefix = f"{dist_optim.PREFIX}{stored}.{model_prefix}"
        view = dist_optim_flattened.ModelSpaceView(dcp, prefix, where) if form == dist_optim_flattened.FORM else dcp
        shards = place_mtp_layers(_collect(view, prefix)[0], cfg.num_layers)
        if cfg.tied_embeddings:
            shards.pop(("output", None), None)
        for key, parts in shards.items():
            want = weight_shards.get(key)
            if want is not None and tuple(parts[0].shape) != tuple(want[0].shape):
                raise CkptError(f"{where}: {stored} optimizer state of {key[0]} (layer {key[1]}) has shape "
                                f"{tuple(parts[0].shape)}, the weight {tuple(want[0].shape)}", dist_optim.HINT)
        return in_model_order(assemble(cfg, shards, policy), cfg) if shards else {}

    return dist_optim.read(common, form, slot_tensors, tensors, consumed, where, rule, ep)


def _lightning_unwrapped(common: dict) -> dict:
    """NeMo 2 keeps the optimizer's common entry as a one-element list (MegatronStrategy.save_checkpoint:
    checkpoint["optimizer"] = [optimizer_sharded_state_dict()], NVIDIA/NeMo 8cfedd7): the entry itself, as
    Megatron-LM stores it."""
    opt = common.get("optimizer")
    if isinstance(opt, list) and len(opt) == 1 and isinstance(opt[0], dict):
        return {**common, "optimizer": opt[0]}
    return common


def _slot_canonical(view, cfg: GPTConfig, policy) -> Dict[str, LazyTensor]:
    """One optimizer slot presented under `optimizer.state.<slot>.<model key>` (view.prefix), through the
    weights' key table: canonical name -> tensor."""
    shards = place_mtp_layers(_collect(view, view.prefix)[0], cfg.num_layers)
    if cfg.tied_embeddings:
        shards.pop(("output", None), None)
    return in_model_order(assemble(cfg, shards, policy), cfg) if shards else {}


# --- writing --------------------------------------------------------------------------------

def _global_fqn(role: str) -> str:
    return {v: k for k, v in GLOBAL_KEYS.items()}[role]


def write_torch_dist(ckpt: Checkpoint, out_dir: Path, layout: Layout, opts: WriteOptions = WriteOptions(),
                     progress: Optional[Callable[[int], None]] = None, warn=print) -> WriteSummary:
    """Write ckpt as a megatron-core torch_dist checkpoint (save dir: tracker + iter_XXXXXXX/), as opts say.

    Tensors are full and stacked; `layout` only sets the args (and the vocab padding for its TP):
    megatron-core cuts the shards it needs at load time, whatever its TP/PP. With opts.optimizer (the
    default) and a source holding optimizer state, every slot is written beside the weights in the
    fully_reshardable form (dcp/optim.py), layer by layer, so it loads at any layout too (MoE: the
    optimizer's common entry is the chain megatron-core builds at layout.ep). opts.dialect (mcore / mcore-te) sets
    the target run's transformer_impl (default: the source run's, else Transformer Engine), which names the
    norms of MoE layers and every tensor of an MLA layer (MOE_NORM_NAMES, MLA_WRITE_NAMES). The iteration,
    vocabulary, dtype, training state and args are settled as for the torch format (megatron.plan_megatron).
    """
    _check_target_fits(ckpt.config, layout)
    plan = plan_megatron(ckpt, layout, opts, warn, MegatronArgs(True, False, _transformer_impl(ckpt, opts.dialect), 3.0),
                         hint=dist_optim.HINT)
    it_dir = Path(out_dir) / f"iter_{plan.iteration:07d}"
    out = _DistWrite(DcpWriter(it_dir), ckpt, layout, plan, opts.dtype, progress)
    out.common.update({"args": plan.args, "checkpoint_version": 3.0, "iteration": plan.iteration})
    out.write_model()
    _finish(out, it_dir, Path(out_dir), plan.iteration)
    carried = None
    if out.slots:
        opt = ckpt.optimizer
        carried = {"kind": dist_optim.WRITE_FORM, "step": opt.step, "slots": sorted(out.slots),
                   "groups": len(opt.param_groups)}
    return WriteSummary("torch_dist", 1, out.bytes, tensors=out.chunks, optimizer=carried,
                        dialect="torch_dist", iteration_dir=it_dir.name, padded_vocab_size=plan.rows,
                        checkpoint_version=3.0)


def _check_target_fits(cfg: GPTConfig, layout: Layout) -> None:
    """Refuse a model megatron-core cannot load at layout (the args describe it), before anything is written."""
    check_tensor_parallel(cfg, layout.tp)
    moe = cfg.moe
    if moe is not None:
        layout.local_experts(moe.num_experts, 0)  # validates --ep against the expert count
        require(moe.ffn_hidden_size % layout.tp == 0 and moe.shared_ffn_hidden_size % layout.tp == 0,
                f"--tp {layout.tp} does not divide the expert FFN size {moe.ffn_hidden_size}"
                + (f" / shared expert size {moe.shared_ffn_hidden_size}" if moe.shared_ffn_hidden_size else ""))
    megatron_args.refuse_what_megatron_core_ignores(cfg, "torch_dist is always megatron-core: write --format "
                                                    "torch --dialect legacy")
    layout.chunks(cfg.num_layers)  # validates the pipeline split the args will describe


def _transformer_impl(ckpt: Checkpoint, dialect: Optional[str]) -> str:
    """The target run's transformer_impl: a megatron-core dialect's, else the source run's, else Transformer Engine."""
    if dialect in DIALECTS and dialect.startswith("mcore"):
        return DIALECTS[dialect].transformer_impl
    return getattr(ckpt.source.args, "transformer_impl", None) or "transformer_engine"


class _DistWrite:
    """One torch_dist write: the DCP writer, the weights and optimizer slots to put (megatron.MegatronPlan),
    the common state, and the bytes and chunks written so far."""

    def __init__(self, writer: DcpWriter, ckpt: Checkpoint, layout: Layout, plan: MegatronPlan,
                 dtype: Optional[torch.dtype], progress):
        self.writer, self.ckpt, self.layout, self.plan = writer, ckpt, layout, plan
        self.dtype, self.progress = dtype, progress
        self.cfg, self.tensors, self.args = ckpt.config, plan.tensors, plan.args
        self.args.ckpt_format = "torch_dist"
        self.per_layer = _per_layer_keys(ckpt)
        if self.cfg.moe is not None and not self.per_layer:
            self.args.moe_layer_freq = 1  # every layer MoE, and megatron-core stacks layers only for an int frequency
        self.common: dict = {}
        self.slots = plan.train.slots if plan.train is not None else {}
        self.bytes = self.chunks = 0

    def put(self, fqn: str, t: torch.Tensor, global_shape, offsets, cast: bool = True) -> None:
        if self.dtype is not None and cast:
            t = t.to(self.dtype)
        self.writer.declare(fqn, global_shape, t.dtype)
        self.writer.add_chunk(fqn, t, offsets)
        self.bytes += t.numel() * t.element_size()
        self.chunks += 1
        if self.progress:
            self.progress(t.numel() * t.element_size())

    def put_slots(self, model_key: str, full_of: Callable, at: Tuple[int, ...] = (), lead: Tuple[int, ...] = (),
                  cast: bool = True) -> None:
        """The weight (WEIGHT slot) and every optimizer slot of one parameter: its chunk at index `at` of the
        leading axes `lead` (layer and/or expert) the stored tensor has before the parameter's own."""
        for slot in (WEIGHT,) + tuple(self.slots):
            full = full_of(self.tensors if slot == WEIGHT else self.slots[slot])
            if full is None:
                continue
            t = full.load()
            t = t.reshape((1,) * len(lead) + tuple(t.shape))
            shape, offsets = tuple(lead) + tuple(t.shape[len(lead):]), tuple(at) + (0,) * (t.dim() - len(at))
            if slot == WEIGHT:
                self.put(model_key, t, shape, offsets, cast)
                continue
            first, *aliases = dist_optim.stored_keys(slot, model_key)
            self.put(first, t, shape, offsets, cast=False)
            for alias in aliases:
                self.writer.alias(alias, first)

    def put_global(self, role: str) -> None:
        self.put_slots(_global_fqn(role), lambda ts: global_role_tensor(ts, role))

    def write_model(self) -> None:
        """The optimizer's common entries, then every tensor in megatron-core's order: embeddings, layers, head."""
        if self.slots:
            opt, mixed = self.ckpt.optimizer, self.plan.train.mixed
            self.common.update(dist_optim.common_entries(opt, mixed=mixed, ep=self.layout.ep if self.cfg.moe is not None else 1))
            self.args.dist_ckpt_optim_fully_reshardable = True
        self.put_global("word")
        self.put_global("pos")
        for i in range(self.cfg.num_layers):
            self.write_layer(i)
        self.put_global("final_norm.weight")
        self.put_global("final_norm.bias")
        for k in range(self.cfg.mtp_num_layers):
            self.write_mtp_layer(k)
        if not self.cfg.tied_embeddings:
            self.put_global("output")

    def write_mtp_layer(self, k: int) -> None:
        """MTP layer k: its own tensors (enorm, hnorm, eh_proj, final norm) and its decoder layer (write_layer)."""
        g, prefix = self.cfg.num_layers + k, GPT.mtp_prefix(DIST).format(i=k)
        linear = GPT.with_trait("linear")
        with load_scope():
            for role, name in MTP_WRITE_NAMES.items():
                if layer_role_tensor(self.tensors, self.plan.cfg_out, g, role) is None:
                    continue
                self.put_slots(prefix + name, lambda ts, role=role: layer_role_tensor(ts, self.plan.cfg_out, g, role))
                if role in linear:  # a linear module's (empty) extra state, as for a per-layer decoder layer's
                    self.writer.add_bytes(f"{prefix}{name.rsplit('.', 1)[0]}._extra_state/shard_0_1", NO_EXTRA_STATE)
        self.write_layer(g)

    def _layer_place(self, i: int) -> Tuple[str, tuple, tuple, bool]:
        """(key prefix, index, leading axes, per-layer keys) of layer i: stacked, one [L, ...] tensor per name with
        this layer at index i; per-layer, decoder.layers.{i}.<name>; an MTP layer, under its MTP layer's prefix."""
        if self.cfg.is_mtp_layer(i):
            return GPT.mtp_prefix(DIST).format(i=i - self.cfg.num_layers) + GPT.mtp.inner, (), (), True
        if not self.per_layer:
            return "decoder.layers.", (i,), (self.cfg.num_layers,), False
        return f"decoder.layers.{i}.", (), (), True

    def write_layer(self, i: int) -> None:
        """Layer i's weights and slots, and the extra-state objects megatron-core asks for at load."""
        cfg, moe = self.cfg, self.cfg.moe
        prefix, at, lead, per_layer = self._layer_place(i)
        is_moe = cfg.is_moe_layer(i)
        mla = cfg.mla is not None
        impl = self.args.transformer_impl
        layer_names = MLA_WRITE_NAMES.get(impl, MLA_WRITE_NAMES["transformer_engine"]) if mla else WRITE_NAMES
        names = {**layer_names, **MOE_WRITE_NAMES, **(MOE_NORM_NAMES.get(impl, {}) if is_moe else {})}
        with load_scope():
            for role in LAYER_ROLES + (tuple(MOE_WRITE_NAMES) if is_moe else ()):
                self.put_slots(prefix + names[role],
                               lambda ts, role=role: layer_role_tensor(ts, self.plan.cfg_out, i, role), at, lead,
                               cast=role not in KEEP_STORED_DTYPE)
        if is_moe:
            E = moe.num_experts
            for e in range(E):
                with load_scope():  # one expert at a time: a layer's experts can be many GB
                    for base, name in EXPERT_WRITE_NAMES.items():
                        self.put_slots(prefix + name, lambda ts, base=base, e=e: layer_role_tensor(
                            ts, self.plan.cfg_out, i, expert_role(e, base)), at + (e,), lead + (E,))
        self.write_extra_state(i, prefix, is_moe, mla, per_layer)

    def write_extra_state(self, i: int, prefix: str, is_moe: bool, mla: bool, per_layer: bool) -> None:
        cfg, moe, L = self.cfg, self.cfg.moe, self.cfg.num_layers
        shard = f"{i}_{L}" if not per_layer else "0_1"
        attention = _modules(*(r for r in MLA_LINEARS if GPT.has_role(r, cfg, i))) if mla else ()
        for name in EXTRA_STATE + attention + (SHARED_EXTRA_STATE if is_moe and moe.shared_ffn_hidden_size else ()):
            if not (is_moe and name.startswith("mlp.linear_fc")) and not (mla and ".linear_qkv" in name):
                self.writer.add_bytes(f"{prefix}{name}._extra_state/shard_{shard}", NO_EXTRA_STATE)
        for name in EXPERT_EXTRA_STATE if is_moe else ():
            for e in range(moe.num_experts):
                where = f"{i}.{e}_{L}.{moe.num_experts}" if not per_layer else f"{e}_{moe.num_experts}"
                self.writer.add_bytes(f"{prefix}{name}._extra_state/shard_{where}", NO_EXTRA_STATE)


def _finish(out: _DistWrite, it_dir: Path, out_dir: Path, iteration: int) -> None:
    """The common state, the DCP index, metadata.json and the tracker."""
    # Common state twice: common.pt for older readers, the common_state entry for newer ones.
    # Written by our streaming pickler so StandIn enums from a source's args keep their names.
    save_streaming(out.common, it_dir / "common.pt")
    blob = it_dir / ".common_state.tmp"
    save_streaming([out.common], blob)
    out.writer.add_bytes(COMMON_KEY, blob.read_bytes())
    blob.unlink()
    out.writer.finish()
    (it_dir / CONFIG_FILE).write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                  "common_backend": "torch", "common_backend_version": 1}))
    (out_dir / TRACKER).write_text(str(iteration))


def _per_layer_keys(ckpt: Checkpoint) -> bool:
    """Whether layers are stored under decoder.layers.{i}.* instead of stacked, as megatron-core asks at load
    (transformer_block.py): for MoE models whose --moe-layer-freq is a list or an int above 1, which an
    MoE model whose layers are not all MoE always has; an all-MoE model follows its source run's flag
    (stacked for the default int 1). Dense models: stacked."""
    moe = ckpt.config.moe
    if moe is None:
        return False
    if set(moe.layers) != set(range(ckpt.config.num_layers)):
        return True
    freq = getattr(ckpt.source.args, "moe_layer_freq", 1)  # args: only sources that store Megatron's carry them
    return not isinstance(freq, int)
