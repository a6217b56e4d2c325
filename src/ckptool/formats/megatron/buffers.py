"""megatron-core's grad-buffer layout, where the distributed optimizer's flat state puts each parameter.

Torch-free, so the quick inspect (formats/megatron/quick_distopt.py) and the full readers and writers
(megatron/distopt.py for distrib_optim.pt, dcp/optim_buckets.py for torch_dist's dp_reshardable form)
lay buffers out by one set of rules; megatron/distopt.py's docstring says what they are and where
megatron-core keeps them (megatron/core/distributed/param_and_grad_buffer.py). ERAS holds how each
span of megatron-core versions aligns parameters, pads bucket ends and saves the buffers; buffer_layout
lays one buffer out; bucket_sizes says which bucket sizes a run may have used; stage_layers which
layers each pipeline stage (and so its buffers) holds. For torch_dist's flat forms (dcp/optim_buckets.py,
and formats/dcp/quick_buckets.py checking them without torch): which optimizers a run has (Part: one, or
megatron-core's [dense, expert] chain), where each saves its model-parallel ranks (grid), which
parameters each buffer holds in which order (registered_roles), and the stored bucket sizes
(parse_unpadded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...errors import CkptError
from ...spec import GPT, schema
from ...quick.meta import rank_shape  # torch-free: a role's shape on its rank, shared with the quick inspect
from .groups import HINT
from .names import DIALECTS
from ...config import Layout

KEYS = ("param", "exp_avg", "exp_avg_sq")  # distrib_optim.pt's names for the master and the two moments
SLOT_OF_KEY = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DEFAULT_BUCKET = 40_000_000  # megatron-core's default bucket size floor (max(40M, 1M x DP))
# the tied word embedding (first stage) and its head copy (last stage; role head_copy in the legacy
# dialects, output in megatron-core's): megatron-core marks them shared_embedding when PP > 1
SHARED_EMBEDDING_ROLES = GPT.with_trait("tied_embedding")  # the spec's role trait
# A torch_dist rank's parameters in its buffers (dist_optim_buckets.rank_params): the dialect of each
# transformer_impl gives a layer's order; the first chunk leads with HEAD, the last ends with TAIL and,
# tied at PP > 1, the head's copy of the word embedding (laid out, not read)
DIALECT_OF_IMPL = {"local": "mcore", "transformer_engine": "mcore-te"}


def rule_column(impl: str) -> Optional[str]:
    """The spec column whose TP rules the run's modules follow (Role.rules): Transformer Engine keeps MLA's
    down projections whole on every TP rank, so its flat buffers hold them whole too."""
    return DIALECTS[DIALECT_OF_IMPL[impl]].rule_column
# (the spec's globals in its order: the first stage's by the first_stage trait, the rest the last stage's)
HEAD = GPT.with_trait("first_stage")
TAIL = tuple(t.role for t in GPT.tensors if t.role is not None and not t.axes and t.role not in HEAD)
HEAD_COPY = schema.HEAD_COPY
# args naming the first / last pipeline stage's layer counts (Megatron-LM's, and megatron-core's config)
FIRST_STAGE_ARGS = ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage")
LAST_STAGE_ARGS = ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage")


@dataclass(frozen=True)
class Era:
    """How one span of megatron-core versions lays a grad buffer out and saves it."""
    name: str
    param_align: int  # each parameter starts at a multiple of this many elements (1: packed)
    bucket_multiple: Callable[[int], int]  # bucket ends padded to a multiple of this (from the DP size)
    form: str  # "coalesced" | "bucket-list"
    since: str = ""  # the era's first month: how --distrib-optim-era names it


ERAS = (  # newest first: a source is read by the first era whose layout matches its stored sizes
    Era("megatron-core 2024-07 and later", 64, lambda dp: math.lcm(dp, 128), "coalesced", "2024-07"),
    Era("megatron-core 2024-05..06", 1, lambda dp: math.lcm(dp, 128), "coalesced", "2024-05"),
    Era("megatron-core 2024-04", 1, lambda dp: dp, "coalesced", "2024-04"),
    Era("megatron-core 2024-02..03", 1, lambda dp: dp, "bucket-list", "2024-02"),
)
CURRENT = ERAS[0]
ERA_BY_SINCE = {e.since: e for e in ERAS}


@dataclass
class BufferLayout:
    """Where each parameter of one grad buffer sits. Parameter i (registration order) occupies
    [start[i], start[i] + numel) of bucket bucket_of[i] (offsets from the bucket's start)."""
    start: List[int]
    bucket_of: List[int]
    bucket_unpadded: List[int]
    bucket_padded: List[int]

    @property
    def numel_unpadded(self) -> int:
        return sum(self.bucket_unpadded)

    def coalesced_offset(self, i: int) -> int:
        """Parameter i's offset in the coalesced world tensors (every bucket's unpadded part in turn)."""
        return sum(self.bucket_unpadded[:self.bucket_of[i]]) + self.start[i]

    def padded_offset(self, i: int) -> int:
        """Parameter i's offset in the whole padded buffer."""
        return sum(self.bucket_padded[:self.bucket_of[i]]) + self.start[i]


def buffer_layout(numels: Sequence[int], shared: Sequence[bool], era: Era, dp: int,
                  bucket_size: Optional[int]) -> BufferLayout:
    """megatron-core's layout of one grad buffer holding parameters of these sizes (registration order);
    shared[i]: the parameter is a tied embedding copy across pipeline stages (a bucket of its own)."""
    n = len(numels)
    start, bucket_of = [0] * n, [0] * n
    unpadded: List[int] = []
    padded: List[int] = []
    pos = 0  # next free element, relative to the current bucket's start
    members = 0

    def close(end: int) -> None:
        nonlocal pos, members
        unpadded.append(end)
        padded.append(math.ceil(end / era.bucket_multiple(dp)) * era.bucket_multiple(dp))
        pos, members = 0, 0

    for i in reversed(range(n)):  # backprop order
        pos = math.ceil(pos / era.param_align) * era.param_align
        if shared[i] and members:
            close(pos)  # the bucket so far ends at the (aligned) start this parameter would have had
        start[i], bucket_of[i] = pos, len(unpadded)
        pos += numels[i]
        members += 1
        if shared[i] or (bucket_size is not None and pos >= bucket_size):
            close(pos)
    if members:
        close(pos)
    return BufferLayout(start, bucket_of, unpadded, padded)


def bucket_sizes(args, chunk: int, pp_rank: int, dp: int) -> List[Optional[int]]:
    """The bucket sizes the run may have used for this chunk, most likely first (megatron-core cuts
    buckets only with --overlap-grad-reduce, on pipeline stage 0, in model chunk 0)."""
    if chunk > 0 or pp_rank > 0 or not getattr(args, "overlap_grad_reduce", False) \
            or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return [None]
    given = getattr(args, "ddp_bucket_size", None)
    # None last: a file written for a run without bucketing (ckptool's writer) under args that had it
    return ([given] if given else [max(DEFAULT_BUCKET, 1_000_000 * dp), DEFAULT_BUCKET]) + [None]


def is_shared_embedding(role: str, tied: bool, pp: int, mtp: bool = False) -> bool:
    """Whether a parameter of this role is bucketed alone (SHARED_EMBEDDING_ROLES, tied, PP > 1). MTP (issue 30):
    with MTP layers megatron-core 0.16.1 marks the word embedding shared on the first stage and its copy on the
    MTP stage, tied or not, and not the output layer there (LanguageModule.setup_embeddings_and_output_layer)."""
    if mtp:
        return pp > 1 and role == "word"
    return tied and pp > 1 and role in SHARED_EMBEDDING_ROLES


def file_form(state: dict) -> Optional[str]:
    """distrib_optim.pt's form by its marker keys (ERAS' `form`), None for the forms before 2024-02."""
    if state.get("buckets_coalesced") is True:
        return "coalesced"
    if "per_bucket_numel_unpadded" in state:
        return "bucket-list"
    return None


def _arg(args, names) -> Optional[int]:
    return next((int(getattr(args, n)) for n in names if getattr(args, n, None)), None)


def virtual_pipeline_size(args, num_layers: int) -> Optional[int]:
    """The run's virtual pipeline chunks per stage as its args say, None without interleaving.

    Megatron-LM's validate_args stores the size it runs with as virtual_pipeline_model_parallel_size in
    every era since interleaving exists (2021-02 dd88906: the flag itself; from dcef906 derived from
    --num-layers-per-virtual-pipeline-stage, later also from --num-virtual-stages-per-pipeline-rank or
    --pipeline-model-parallel-layout; a size of 1 becomes None): where the args hold it, it is the size the run
    ran with. Args that never went through validate_args keep only the flags: derived from them as
    validate_args does (layers per stage, counting the embedding and the loss where
    account_for_*_in_pipeline_split says so, over layers per virtual stage)."""
    if hasattr(args, "virtual_pipeline_model_parallel_size"):
        vpp = args.virtual_pipeline_model_parallel_size
    else:
        vpp = _first_given(args, "num_virtual_stages_per_pipeline_rank")
        per_chunk = _first_given(args, "num_layers_per_virtual_pipeline_stage")
        if vpp is None and per_chunk:
            pp = _first_given(args, "pipeline_model_parallel_size", default=1)
            counted = num_layers + sum(bool(_first_given(args, f"account_for_{part}_in_pipeline_split", default=False))
                                       for part in ("embedding", "loss"))
            vpp = counted // pp // int(per_chunk)
    return int(vpp) if vpp is not None and int(vpp) > 1 else None


def _first_given(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def stage_layers(args, num_layers: int, pp: int, where: str) -> List[int]:
    """Layers per pipeline stage: the args' first / last stage counts, the stages between them split
    evenly."""
    first, last = _arg(args, FIRST_STAGE_ARGS), _arg(args, LAST_STAGE_ARGS)
    if pp == 1:
        return [num_layers]
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    counts = None
    if middle > 0 and rest >= 0 and rest % middle == 0:
        counts = [first] * (first is not None) + [rest // middle] * middle + [last] * (last is not None)
    elif middle == 0 and rest == 0:
        counts = [first, last]
    if counts is None:
        raise CkptError(f"{where}: the args' pipeline split (first stage {first}, last stage {last} layers, the "
                        f"others even) does not fit {num_layers} layers on {pp} stages", HINT)
    return counts


# --- the optimizers of a run and the parameters of each one's buffers (torch_dist's flat forms) -------------

# roles that are module buffers, not parameters (the spec's "buffer" trait): in no grad buffer (the router's
# expert bias is updated by its own rule, not by the optimizer)
NOT_PARAMETERS = GPT.with_trait("buffer")
LAYER_ROLES = tuple(r.name for r in GPT.role_list("layer"))


@dataclass(frozen=True)
class Part:
    """One optimizer of the run as the flat forms store it. At EP > 1 with experts megatron-core chains a
    dense DistributedOptimizer (every parameter all-reduced over DP: all but the experts) and an expert one
    (the experts' expert_parallel_buffers), and ChainedOptimizer.sharded_state_dict prefixes each one's
    keys chained_N. (the flat forms are not fully reshardable, so chained_optim_avoid_prefix does not
    apply). The two index their model-parallel groups differently (get_megatron_optimizer): the dense one
    by the rank in the TP x PP group (pp x TP + tp), the expert one in the expert TP x EP x PP group
    ((pp x EP + ep) x ETP + expert-TP rank)."""
    prefix: str  # "" (one optimizer) or "chained_N."
    experts: Optional[bool]  # None: every parameter (one optimizer); False: all but the experts; True: the experts


ONE = (Part("", None),)
CHAIN = (Part("chained_0.", False), Part("chained_1.", True))


def parts(cfg, ep: int) -> Tuple[Part, ...]:
    """The optimizers of a run: megatron-core's [dense, expert] chain for an MoE model at EP > 1 (its
    experts' `allreduce` attribute is False only then), else one."""
    return CHAIN if cfg.moe is not None and ep > 1 else ONE


@dataclass(frozen=True)
class BufferRank:
    """One model-parallel rank's grad buffer of one pipeline chunk in one optimizer part: its layers, whether
    its chunk is the model's first / last, its save index mp (grid), TP (or expert-TP) rank t, EP rank e."""
    pp_rank: int
    chunk: int
    layers: range
    first: bool
    last: bool
    mp: int
    t: int
    e: int


@dataclass(frozen=True)
class FlatRun:
    """The model-parallel grid a run's flat optimizer buffers (torch_dist dp_reshardable /
    dp_zero_gather_scatter) are laid out on, as its args say: read by the full reader and quick inspect."""
    tp: int
    pp: int
    vpp: int
    dp: int
    ep: int
    etp: int
    impl: str
    grouped: bool  # TEGroupedMLP's fc-by-fc expert order (grouped_linears)
    chunks: Tuple[Tuple[int, int, int, int], ...]  # (pp rank, chunk, first layer, count), sorted

    @classmethod
    def of(cls, args, cfg, where: str) -> "FlatRun":
        """From the run's args (CkptError where its pipeline split does not fit the layers)."""
        tp = getattr(args, "tensor_model_parallel_size", None) or 1
        pp = getattr(args, "pipeline_model_parallel_size", None) or 1
        vpp = virtual_pipeline_size(args, cfg.num_layers) or 1
        moe = cfg.moe is not None
        split = stage_layers(args, cfg.num_layers, pp, where) if vpp == 1 else None
        chunks = Layout(tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, stage_layers=split).chunks(cfg.num_layers)
        return cls(tp=tp, pp=pp, vpp=vpp, dp=int(getattr(args, "data_parallel_size", None) or 1),
                   ep=int(getattr(args, "expert_model_parallel_size", None) or 1) if moe else 1,
                   etp=int(getattr(args, "expert_tensor_parallel_size", None) or tp) if moe else tp,
                   impl=getattr(args, "transformer_impl", "transformer_engine"), grouped=grouped_linears(args),
                   chunks=tuple(sorted(chunks)))

    def buffer_ranks(self, part: Part):
        """Every model-parallel rank's buffer of each chunk in `part`, chunk by chunk in the save's order."""
        for pp_rank, chunk, first_layer, count in self.chunks:
            for mp, t, e in grid(part, pp_rank, self.tp, self.etp, self.ep):
                yield BufferRank(pp_rank, chunk, range(first_layer, first_layer + count), pp_rank == 0 and chunk == 0,
                                 pp_rank == self.pp - 1 and chunk == self.vpp - 1, mp, t, e)


def is_expert(role: str) -> bool:
    return role.startswith("experts.")


def grid(part: Part, pp_rank: int, tp: int, etp: int, ep: int) -> List[Tuple[int, int, int]]:
    """(dp_group_idx, TP (or expert-TP) rank, EP rank) of each model-parallel rank of a stage, in the
    index the part's optimizer saves under (Part)."""
    if part.experts:
        return [((pp_rank * ep + e) * etp + s, s, e) for e in range(ep) for s in range(etp)]
    return [(pp_rank * tp + t, t, 0) for t in range(tp)]


FLAT_PREFIX = "optimizer.distributed.dp_group_idx_{mp}."  # a model-parallel rank's buffers in torch_dist


def stored_prefix(keys, part: Part, mp: int) -> str:
    """The key prefix (among the DCP keys) of model-parallel rank mp's buffers of this optimizer. A rank
    without expert parameters (a pipeline stage without MoE layers) builds no expert optimizer, and a chain
    of one saves its optimizer unprefixed (ChainedOptimizer.sharded_state_dict): its dense buffers then sit
    under the bare prefix."""
    prefix = part.prefix + FLAT_PREFIX.format(mp=mp)
    if part.experts is False and not any(k.startswith(prefix) for k in keys):
        bare = FLAT_PREFIX.format(mp=mp)
        if any(k.startswith(bare) for k in keys):
            return bare
    return prefix


def grouped_linears(args) -> bool:
    """Whether the experts are TEGroupedMLP's grouped linears (--moe-grouped-gemm with Transformer Engine),
    which register every local expert's fc1 before any fc2 (their weight0 .. weightN-1); SequentialMLP
    registers expert by expert. The legacy GroupedMLP (one tensor per fc) is not laid out (unsupported)."""
    return bool(getattr(args, "moe_grouped_gemm", False)) and not getattr(args, "moe_use_legacy_grouped_gemm", False) \
        and getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"


def unsupported(args) -> Optional[str]:
    """Why this run's buffer layout is not recomputed, or None."""
    if getattr(args, "transformer_impl", "transformer_engine") not in DIALECT_OF_IMPL:
        return f"transformer_impl {getattr(args, 'transformer_impl', None)!r}"
    if getattr(args, "moe_grouped_gemm", False) and not grouped_linears(args):
        return "the legacy GroupedMLP (--moe-grouped-gemm without Transformer Engine, or --moe-use-legacy-grouped-gemm)"
    return None


def registered_roles(cfg, impl: str, layers: range, first: bool, last: bool, pp: int, experts: range,
                     grouped: bool, holds: Callable[[str, Optional[int]], bool]) -> List[Tuple[str, Optional[int]]]:
    """(role, layer) of a pipeline chunk's parameters in registration order (the dialect's param_order within a
    layer, its MLA layer's own order in an MLA model: Transformer Engine's MLA modules register otherwise; an MoE layer's router, its local experts (global indices `experts`; fc by fc when `grouped`:
    grouped_linears) and shared expert in its MLP's place, after the pre-MLP norm, as megatron-core's MoELayer
    registers them); first / last: the chunk holds HEAD / TAIL, and with tied embeddings at PP > 1 the head's
    copy of the word embedding (role HEAD_COPY). holds(role, layer): whether the model has that tensor."""
    out: List[Tuple[str, Optional[int]]] = []
    if first:
        out += [(role, None) for role in HEAD if holds(role, None)]
    elif last and cfg.mtp_num_layers and holds("word", None):  # MTP's copy of the word embedding, registered first
        out.append(("word", None))
    for i in layers:
        out += [(role, i) for role in DIALECTS[DIALECT_OF_IMPL[impl]].layer_param_order(cfg.mla is not None)
                if role in LAYER_ROLES and holds(role, i)]
        if cfg.is_moe_layer(i):
            roles = GPT.moe_layer_roles(experts)
            out += [(role, i) for role in (schema.fc_major(roles) if grouped and len(experts) else roles)
                    if role not in NOT_PARAMETERS and holds(role, i)]
    if last:
        out += [(role, None) for role in TAIL if holds(role, None)]
        if cfg.tied_embeddings and pp > 1 and holds("word", None):
            out.append((HEAD_COPY, None))
    return out


def rank_param_shapes(shapes: Dict[str, Tuple[int, ...]], cfg, run: "FlatRun", r: BufferRank,
                      part: Part) -> Optional[List[Tuple[str, Optional[int], Tuple[int, ...]]]]:
    """(role, layer, shape on its rank) of buffer rank r's parameters in optimizer `part`, in registration
    order (registered_roles), from the canonical shapes: a role's rank shape by its TP rule (quick.meta.rank_shape:
    a routed expert's over the expert TP size, EP rank r.e holding its own experts; the dialect's rule column,
    so Transformer Engine's MLA down projections stay whole). The full reader and the quick inspect both
    lay a torch_dist buffer out from this list. None where a role does not split evenly (each caller says so
    its own way)."""
    experts = range(0)
    if cfg.moe is not None:
        local = cfg.moe.num_experts // run.ep
        experts = range(r.e * local, (r.e + 1) * local)

    def holds(role: str, layer: Optional[int]) -> bool:
        return rank_shape(role, layer, cfg, shapes, 1) is not None

    out = []
    for role, layer in registered_roles(cfg, run.impl, r.layers, r.first, r.last, run.pp, experts, run.grouped,
                                        holds):
        expert = is_expert(role)
        if part.experts is not None and expert != part.experts:
            continue
        shape = rank_shape(role, layer, cfg, shapes, run.etp if expert else run.tp, rule_column(run.impl))
        if shape is None:
            return None
        out.append((role, layer, shape))
    return out


def matching_layout(numels: List[int], shared: List[bool], stored, args, chunk: int, pp_rank: int,
                    dp: int) -> Tuple[Optional[BufferLayout], List[str]]:
    """The buffer layout (of the bucket sizes the run may have used) that reproduces a torch_dist buffer's
    stored per_bucket_numel_unpadded (a list), or its total numel_unpadded (an int, the gathered form); with
    the layouts tried, for the caller's message. shared[i]: parameter i is bucketed alone.

    Besides the args' bucket size (or megatron-core's default), each stored bucket size is tried as the
    bucket size: a bucket closes at the first parameter end reaching the bucket size, so the smallest end
    of a bucket closed that way is itself a bucket size giving the same cuts. This reads runs whose size
    the args do not say (newer Megatron-LM derives it); the layout reproducing every stored size places
    every parameter as the run did, whichever size produced it."""
    tried = []
    sizes = bucket_sizes(args, chunk, pp_rank, dp)
    if sizes != [None] and isinstance(stored, list) and len(stored) > 1:
        sizes = sizes[:-1] + sorted(set(stored) - set(sizes)) + [None]
    for size in sizes:
        lay = buffer_layout(numels, shared, CURRENT, dp, size)
        if lay.bucket_unpadded == stored or lay.numel_unpadded == stored:  # per bucket, or the total
            return lay, tried
        tried.append(f"{lay.bucket_unpadded} (bucket size {size})")
    return None, tried


def era_layout(numels: List[int], shared: List[bool], form: str, want, args, chunk: int, pp_rank: int, dp: int,
               bucket_dp: Optional[int] = None) -> Tuple[Optional[Tuple[BufferLayout, Era]], List[str]]:
    """The first era of distrib_optim.pt's `form` (and bucket size) whose layout of these parameters reproduces
    the stored sizes `want` (coalesced: the total numel_unpadded; bucket-list: each padded bucket's size), with
    the layouts tried for the caller's message. dp: the size the buffer was sharded over; bucket_dp: the one its
    default bucket size comes from. The full reader (megatron_distopt) and the quick inspect both ask this."""
    tried = []
    for era in (e for e in ERAS if e.form == form):
        for size in bucket_sizes(args, chunk, pp_rank, bucket_dp or dp):
            layout = buffer_layout(numels, shared, era, dp, size)
            got = layout.numel_unpadded if form == "coalesced" else layout.bucket_padded
            if got == want:
                return (layout, era), tried
            tried.append(f"{era.name}: {got}")
    return None, tried


def parse_unpadded(obj) -> List[List[int]]:
    """A rank's stored per_bucket_numel_unpadded ([[{(param dtype, grad dtype): [numel per bucket]} per grad
    buffer]]) as per grad buffer the bucket sizes; ValueError for any other shape or several dtypes per buffer
    (the full reader's one-line error, the quick reader's fall-back)."""
    try:
        (per_buffer,) = obj
        out = []
        for per_dtype in per_buffer:
            (sizes,) = per_dtype.values()
            out.append([int(n) for n in sizes])
    except (TypeError, ValueError, AttributeError):
        raise ValueError("not grad buffers (one per model chunk) of one dtype each") from None
    return out


# --- megatron-core's [dense, expert] chain in the torch format (distrib_optim.pt) ------------------------------

def chain_sources(t: int, e: int, tp: int, ep: int, etp: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(TP rank, EP rank) of the rank files whose distrib_optim.pt holds the chain's [dense, expert] parts
    for the ranks of file (t, e) of a pipeline stage.

    ChainedOptimizer.save_parameter_state saves each part on that optimizer's DP rank 0 only, into the
    saving rank's own file. In a stage, rank x is dense TP rank x % TP, dense DP rank x // TP, expert-TP
    rank x % ETP, EP rank (x // ETP) % EP, expert DP rank x // (ETP x EP) (megatron-core's rank order
    tp-cp-ep-dp-pp, megatron.expert_grid). So TP rank t's dense state is saved by rank t, into file
    (t, (t // ETP) % EP), and the experts of (expert-TP rank t % ETP, EP rank e) by rank t % ETP + ETP x e,
    into file ((t % ETP + ETP x e) % TP, e). With ETP = TP: EP rank 0's file and the file itself."""
    writer = t % etp + etp * e
    return (t, (t // etp) % ep), (writer % tp, e)


def data_parallel_size(args, expert: bool) -> int:
    """The data-parallel size an optimizer of the run was sharded over: the dense one's, or (expert) the
    expert-data-parallel size megatron-core derives for the same world (world / (expert TP x EP x PP))."""
    dp = int(getattr(args, "data_parallel_size", 0) or 0)
    if not expert or not dp:  # args without the DP size: 1 (it shapes only bucket padding, checked by size)
        return dp or 1
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if (dp * tp) % (etp * ep):
        raise CkptError(f"the run's args give DP {dp} x TP {tp}, which expert TP {etp} x EP {ep} does not divide",
                        HINT)
    return dp * tp // (etp * ep)
