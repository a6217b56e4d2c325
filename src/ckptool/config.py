"""The architecture of a GPT model, independent of how any framework stores it.

GPTConfig holds only facts about the maths (sizes, norms, activations, positions); where tensors
live on disk is the format modules' business. Layout says how a Megatron-style checkpoint is cut
into tensor/pipeline/virtual-pipeline pieces.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional, Sequence, Tuple

from .errors import CkptError, require

NORMALIZATIONS = ("layernorm", "rmsnorm")
# geglu: gelu_tanh(gate) * up (Gemma); quick_geglu (GPT-OSS): gate * sigmoid(1.702 * gate) * up, megatron-core's
# --quick-geglu (activations.quick_gelu)
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "geglu", "quick_geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")
POSITION_EMBEDDINGS = ("learned", "rope", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoE:
    """The routing maths of a Mixture-of-Experts model (dropless: every token reaches its top_k).

    Per token: scores = score_function(router logits); the top_k experts are chosen by scores (plus
    the expert bias when there is one: it steers the choice, never the weights); their weights are
    the chosen scores, divided by their sum when topk_norm, times scaling_factor. The layer's output
    is the weighted sum of the chosen experts' MLPs (gated like the model's), plus the shared expert (scaled by
    sigmoid(x . shared_gate) when shared_gate). Layers not in `layers` are dense MLPs of the
    model's ffn_hidden_size.
    """
    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each routed expert's intermediate size
    layers: Tuple[int, ...]  # global indices of the MoE layers
    score_function: str = "softmax"
    topk_norm: bool = False
    scaling_factor: float = 1.0
    router_bias: bool = False  # the router linear has a bias
    expert_bias: bool = False  # DeepSeek's e_score_correction_bias / Megatron's expert_bias
    shared_ffn_hidden_size: int = 0  # the shared expert's intermediate size; 0: none
    shared_gate: bool = False  # Qwen2-MoE: shared output times sigmoid(x @ shared_gate.weight)
    # Group-limited routing (DeepSeek): experts fall into num_groups equal groups; a group's score is
    # the sum of its two best choice scores; experts are chosen only from the group_topk best groups.
    num_groups: int = 1
    group_topk: int = 1

    def __post_init__(self):
        require(self.score_function in SCORE_FUNCTIONS, f"unknown router score function {self.score_function!r}")
        require(1 <= self.top_k <= self.num_experts,
                f"top-k {self.top_k} is not between 1 and the {self.num_experts} experts")
        require(not self.shared_gate or self.shared_ffn_hidden_size > 0, "a shared-expert gate needs a shared expert")
        require(self.num_experts % self.num_groups == 0 and 1 <= self.group_topk <= self.num_groups,
                f"{self.num_experts} experts cannot be routed in {self.num_groups} groups, best {self.group_topk}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (DeepSeek-V3): frequencies blended between interpolated (/ factor) and
    original by a linear ramp over the dimensions between the beta_fast and beta_slow rotation
    counts; cos/sin times attention_gain; with mscale_all_dim, MLA's softmax scale times
    softmax_gain. The fields and their defaults are Hugging Face's rope_scaling."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None  # None: derived from factor, mscale, mscale_all_dim
    truncate: bool = True

    @property
    def attention_gain(self) -> float:
        """What cos and sin are multiplied by: attention_factor, else (transformers' rule) the ratio of
        the two mscales when both are set, else the plain correction of the factor."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_gain(self) -> float:
        """What MLA's softmax scale 1/sqrt(qk head dim) is multiplied by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class MLA:
    """Multi-Latent Attention (DeepSeek-V2/V3): q from a low-rank latent (or projected directly when
    q_lora_rank is None); k and v from a shared kv latent, plus one rotary key part shared by all
    heads. Each head's query/key is [nope | rope] (qk_nope_head_dim + qk_rope_head_dim), its value
    v_head_dim; only the rope part is rotated. The latents are RMS-normalised with latent_norm_eps."""
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# Which layers are MoE, by each framework's own index rule (layer indices are 0-based and global).
def moe_layers_qwen(num_layers: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> Tuple[int, ...]:
    """Qwen2/3-MoE: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    require(decoder_sparse_step >= 1, f"decoder_sparse_step {decoder_sparse_step} must be at least 1")
    dense = set(mlp_only_layers or ())
    return tuple(i for i in range(num_layers) if (i + 1) % decoder_sparse_step == 0 and i not in dense)


def moe_layers_first_k_dense(num_layers: int, first_k_dense: int, freq: int = 1) -> Tuple[int, ...]:
    """DeepSeek: the first first_k_dense_replace layers are dense; later layer i is MoE when i % freq == 0."""
    return tuple(i for i in range(num_layers) if i >= first_k_dense and i % freq == 0)


def moe_layers_megatron(num_layers: int, moe_layer_freq) -> Tuple[int, ...]:
    """Megatron's --moe-layer-freq: an int N (layer i is MoE when i % N == 0) or a 0/1 list, one per layer."""
    if isinstance(moe_layer_freq, int):
        return tuple(i for i in range(num_layers) if i % moe_layer_freq == 0)
    flags = list(moe_layer_freq)
    require(len(flags) == num_layers, f"--moe-layer-freq lists {len(flags)} layers, the model has {num_layers}")
    return tuple(i for i, f in enumerate(flags) if f)


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    padded_vocab_size: int  # rows of the word embedding as held in this state
    max_position_embeddings: int
    num_query_groups: Optional[int] = None  # None means plain multi-head attention
    head_dim: Optional[int] = None  # None means hidden_size // num_attention_heads
    vocab_size: Optional[int] = None  # the true vocabulary; None when nothing says it
    vocab_size_source: str = "unknown"
    make_vocab_size_divisible_by: int = 128
    position_embedding: str = "learned"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling_factor: Optional[float] = None  # llama3-style scaling (megatron use_rope_scaling)
    normalization: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = True
    tied_embeddings: bool = True
    apply_layernorm_1p: bool = False  # stored gamma is zero-centred: the norm uses (1 + w)
    qk_layernorm: bool = False
    post_layernorm_residual: bool = False  # apply_residual_connection_post_layernorm
    moe: Optional[MoE] = None  # None: a dense model
    mla: Optional[MLA] = None  # None: grouped-query attention (attn.q/k/v)
    rope_yarn: Optional[Yarn] = None  # YaRN scaling (MLA models; GPT-OSS's plain attention)
    # --- Gemma 2 / 3 maths (issue 32; helper gemma). Defaults: the plain GPT maths above. -------------------
    embedding_scale: bool = False  # the word embedding's output times sqrt(hidden_size), cast to its dtype first
    post_norms: bool = False  # attention and MLP outputs normed (attn_post_norm, mlp_post_norm) before the residual
    query_pre_attn_scalar: Optional[float] = None  # attention scores times its -1/2 power; None: head_dim's
    attn_softcap: Optional[float] = None  # attention scores -> cap * tanh(scores / cap) before the mask
    final_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    # sliding windows (Gemma's local layers, GPT-OSS's sliding_attention layers): a local layer's query sees itself
    # and the sliding_window - 1 keys before it (transformers' sliding_window: key k seen from q when q - W < k <= q)
    sliding_window: Optional[int] = None
    local_layers: Tuple[int, ...] = ()  # global indices of the sliding-window (local) layers
    rotary_base_local: Optional[float] = None  # the local layers' RoPE base (Gemma 3); None: rotary_base
    rope_linear_factor: Optional[float] = None  # global layers' linear RoPE scaling: positions / factor (Gemma 3)
    # --- end Gemma -------------------------------------------------------------------------------------------
    # --- multi-token prediction (MTP) ---
    # DeepSeek-V3's MTP modules (megatron-core --mtp-num-layers, HF num_nextn_predict_layers): MTP layer k is a
    # decoder layer at global index num_layers + k (as Hugging Face numbers it) with its own enorm, hnorm, eh_proj
    # and final norm; it shares the main model's embedding and output head. They do not change the main logits.
    mtp_num_layers: int = 0
    # --- GPT-OSS: attention sinks, sliding windows, clamped GLU (issue 32) ---------------------------
    # attn_sinks: a learned logit per head joins each softmax's denominator (megatron-core --softmax-type learnable,
    # DotProductAttention.softmax_offset; transformers GptOssAttention.sinks) and takes its share of the weight
    attn_sinks: bool = False
    # (its sliding windows are sliding_window / local_layers above, shared with Gemma)
    # a gated MLP's gate clamped to <= glu_clamp and its linear half to [-glu_clamp, glu_clamp] before the
    # activation (megatron-core --activation-func-clamp-value); the linear half plus glu_linear_offset after it
    glu_clamp: Optional[float] = None
    glu_linear_offset: float = 0.0
    # the model family (spec/__init__.py FAMILIES: which spec names this model's tensors); a class constant, not
    # a field: every GPTConfig is a GPT, and a config of another family would be its own class
    family: ClassVar[str] = "gpt"

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.head_dim is None:
            require(self.hidden_size % self.num_attention_heads == 0,
                    f"hidden size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads",
                    "give the head size (kv_channels) explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.normalization in NORMALIZATIONS, f"unknown normalization {self.normalization!r}")
        require(self.activation in ACTIVATIONS, f"unknown activation {self.activation!r}")
        require(self.position_embedding in POSITION_EMBEDDINGS,
                f"unknown position embedding {self.position_embedding!r}")
        require(self.num_attention_heads % self.num_query_groups == 0,
                f"{self.num_attention_heads} attention heads cannot be split into "
                f"{self.num_query_groups} query groups")
        self._check_gemma()
        if self.moe is not None and not self.moe.layers:
            # a model without MoE layers is a dense model (a DeepSeek whose first_k_dense_replace covers every
            # layer, Megatron args whose --moe-layer-freq list is all zeros): one form for it, so every writer
            # writes a dense model (megatron-core's builders take the MoE path whenever --num-experts is set)
            self.moe = None
        if self.moe is not None:
            require(all(0 <= i < self.num_layers for i in self.moe.layers),
                    f"MoE layers {list(self.moe.layers)} fall outside the {self.num_layers} layers")
        # GPT-OSS: not with MLA (no framework computes sinks or windows there)
        require(self.mla is None or (self.sliding_window is None and not self.attn_sinks),
                "sliding windows or attention sinks with Multi-Latent Attention: ckptool does not compute them",
                "such a model is not converted")

    def _check_gemma(self) -> None:
        """The Gemma fields (issue 32) hold together: a window where local layers are named, layers that exist."""
        self.local_layers = tuple(int(i) for i in self.local_layers)
        require(all(0 <= i < self.num_layers for i in self.local_layers),
                f"sliding-window layers {list(self.local_layers)} fall outside the {self.num_layers} layers")
        require(bool(self.local_layers) == (self.sliding_window is not None),
                "a sliding window needs the layers it applies to, and local layers need a window")
        require(self.sliding_window is None or self.sliding_window >= 1,
                f"sliding window {self.sliding_window} must be at least 1")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        """True when fc1 holds two halves (gate and up), as SwiGLU, GeGLU and GPT-OSS's clamped GLU do."""
        return self.activation in GATED_ACTIVATIONS

    def is_local_layer(self, i: int) -> bool:
        """Layer i attends within the sliding window (Gemma's local layers, GPT-OSS's sliding layers)."""
        return i in self.local_layers

    def window_of(self, i: int) -> Optional[int]:
        """The keys a query of layer i sees (its sliding window), None for full causal attention."""
        return self.sliding_window if self.is_local_layer(i) else None

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i has an MoE MLP. An MTP layer (i >= num_layers) has the last decoder layer's MLP:
        megatron-core builds the MTP block from the decoder's last layer spec (gpt_layer_specs.py
        get_gpt_mtp_block_spec_for_backend, 0.16.1)."""
        if self.moe is None:
            return False
        return i in self.moe.layers or (self.is_mtp_layer(i) and self.num_layers - 1 in self.moe.layers)

    # --- multi-token prediction (MTP) ---
    def is_mtp_layer(self, i: Optional[int]) -> bool:
        return i is not None and self.num_layers <= i < self.num_layers + self.mtp_num_layers

    @property
    def all_layers(self) -> int:
        """The decoder layers and the MTP layers after them (the canonical layer axis)."""
        return self.num_layers + self.mtp_num_layers

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def norm_has_bias(self) -> bool:
        return self.normalization == "layernorm"

    @property
    def true_or_padded_vocab(self) -> int:
        return self.vocab_size if self.vocab_size is not None else self.padded_vocab_size

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

def padded_vocab_size(true_vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return int(math.ceil(true_vocab / multiple) * multiple)


def check_tensor_parallel(cfg: GPTConfig, tp: int) -> None:
    """Refuse a TP size Megatron itself would refuse for this model."""
    require(tp >= 1, f"--tp must be at least 1, got {tp}")
    require(cfg.num_attention_heads % tp == 0,
            f"--tp {tp} does not divide the {cfg.num_attention_heads} attention heads",
            f"choose a TP size that divides {cfg.num_attention_heads}")
    ng = cfg.num_query_groups
    require(ng % tp == 0 or tp % ng == 0,
            f"--tp {tp} neither divides nor is a multiple of the {ng} query groups",
            "Megatron accepts TP sizes that divide the query groups or are multiples of them")
    require(cfg.ffn_hidden_size % tp == 0,
            f"--tp {tp} does not divide the FFN size {cfg.ffn_hidden_size}")


@dataclass
class Layout:
    """How a Megatron-style checkpoint is cut: TP x PP ranks, optional virtual pipeline chunks.

    stage_layers gives the number of layers on each pipeline stage (None = even split).
    """

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    stage_layers: Optional[Sequence[int]] = None
    dp: int = 1
    ep: int = 1  # expert parallelism: EP rank r holds experts r * E/EP .. (r + 1) * E/EP - 1 of each MoE layer
    etp: Optional[int] = None  # expert tensor parallelism (Megatron's --expert-tensor-parallel-size); None: = tp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def chunks(self, num_layers: int) -> list:
        """[(pp_rank, vpp_chunk, first_global_layer, layer_count)] in global layer order."""
        vpp = self.vpp or 1
        if self.vpp:
            require(self.stage_layers is None,
                    "an explicit pipeline split cannot be combined with --vpp")
            require(num_layers % (self.pp * vpp) == 0,
                    f"{num_layers} layers cannot be split evenly into {self.pp} stages x {vpp} "
                    "virtual chunks", "choose --pp and --vpp whose product divides the layer count")
            per = num_layers // (self.pp * vpp)
            counts = {(p, v): per for p in range(self.pp) for v in range(vpp)}
        else:
            if self.stage_layers is not None:
                stage = list(self.stage_layers)
                require(len(stage) == self.pp,
                        f"the pipeline split {stage} has {len(stage)} stages but --pp is {self.pp}")
                require(sum(stage) == num_layers and all(n >= 0 for n in stage),
                        f"the pipeline split {stage} does not add up to the {num_layers} layers")
            else:
                require(num_layers % self.pp == 0,
                        f"{num_layers} layers cannot be split evenly into {self.pp} pipeline stages",
                        "give the split explicitly with --pp-layers (e.g. --pp-layers 3,5)")
                stage = [num_layers // self.pp] * self.pp
            counts = {(p, 0): stage[p] for p in range(self.pp)}
        out, first = [], 0
        for v in range(vpp):
            for p in range(self.pp):
                n = counts[(p, v)]
                out.append((p, v, first, n))
                first += n
        return out

    def describe(self) -> str:
        s = f"TP{self.tp} PP{self.pp}"
        if self.vpp:
            s += f" VPP{self.vpp}"
        if self.ep > 1:
            s += f" EP{self.ep}"
        if self.expert_tp != self.tp:
            s += f" ETP{self.expert_tp}"
        if self.stage_layers:
            s += " layers/stage " + ",".join(map(str, self.stage_layers))
        return s

    def local_experts(self, num_experts: int, ep_rank: int) -> range:
        """The global indices of the experts EP rank ep_rank holds (Megatron's contiguous blocks)."""
        require(self.ep >= 1, f"--ep {self.ep}: the expert-parallel size is at least 1")
        require(num_experts % self.ep == 0, f"--ep {self.ep} does not divide the {num_experts} experts",
                f"choose an EP size that divides {num_experts}")
        n = num_experts // self.ep
        return range(ep_rank * n, (ep_rank + 1) * n)


def parse_stage_layers(text: Optional[str]) -> Optional[list]:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CkptError(f"--pp-layers {text!r} is not a comma-separated list of layer counts",
                        "write it like --pp-layers 3,5")
