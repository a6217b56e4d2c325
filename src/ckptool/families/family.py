"""What a Hugging Face model family is, as one record: the contract every module in families/ fills.

A Family is one HF model class ckptool converts (its config.json `model_type` and `architectures`
name): the tensor names of that class (Names), how its config.json becomes a GPTConfig and back, the
maths flags its config cannot say (Qwen2's QKV-only bias, Qwen3's q/k norms, MLA, where the MoE routing
facts live) and, for export, which GPTConfigs it is the class for. Families of one name scheme share
their tables (llama.py: Llama, Mistral, Qwen2, Qwen3). Torch-free: detection and the quick inspect use it.

Name tables say how each HF tensor is made from canonical tensors (state.py):
  ("copy", name)            the same tensor
  ("T", name)               transposed: GPT-2's Conv1D stores Linear weights as [in, out]
  ("cat", names)            rows concatenated (GPT-2's c_attn bias is [q | k | v])
  ("cat_T", names)          rows concatenated then transposed (GPT-2's c_attn weight)
  ("same", name)            a copy of a main-model tensor an MTP layer stores again (families/mtp.py): the
                            reader checks it equal to that tensor, the writer writes that tensor again
  ("stack", names)          GPT-OSS: every expert's tensor stacked on a leading expert axis ({e} in the names);
  ("stack_T", names)        each transposed first; ("stack_glu", (gate, up)) gate and up rows interleaved
                            (gate f at row 2f, up f at 2f + 1); ("stack_glu_T", (gate, up)) interleaved, transposed
                            (formats/hf/stacked.py computes them; Names.expand lists every expert's names)
The reader applies a table backwards (formats/hf/reader.py), so one table serves both directions. Entries
whose canonical tensors a model lacks (biases of a bias-free model, embed.pos of a RoPE model, the
dense MLP of an MoE layer, the experts of a dense one) are skipped by the writer; the reader skips HF
names absent from the files. MoE tables carry an `{e}` axis (the global expert index) beside the layer's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

from ..config import GPTConfig
from ..errors import CkptError

if TYPE_CHECKING:  # moe.py imports this module
    from .moe import MoeKeys

Entry = Tuple[str, object]


# GPT-OSS: the stacked-experts ops -> canonical tensors per expert
STACKED = {"stack": 1, "stack_T": 1, "stack_glu": 2, "stack_glu_T": 2}


def stacked_part_shape(op: str, shape: tuple) -> tuple:
    """One expert's canonical part (Linear layout [out, in], or a bias [out]) of a stacked tensor of `shape`
    ([E, in, out] for the _T ops, [E, out] else): the reader's split (formats/hf/stacked.py) and the quick reader's."""
    out_rows = shape[2] if op.endswith("_T") else shape[1]
    return (out_rows // STACKED[op],) + ((shape[1],) if op.endswith("_T") else tuple(shape[2:]))


def canonical_names(entry: Entry) -> tuple:
    op, arg = entry
    return tuple(arg) if isinstance(arg, tuple) else (arg,)


def vocab_fields(conf: dict, rows: int) -> dict:
    """GPTConfig's vocabulary fields: the embedding's rows, config.json's vocab_size when it is not more."""
    true_vocab = conf.get("vocab_size")
    if true_vocab is None or true_vocab > rows:
        true_vocab = rows
    return dict(padded_vocab_size=rows, vocab_size=true_vocab, vocab_size_source="config.json vocab_size")


def refuse_export(flag: str, why: str) -> CkptError:
    """The error of an export no HF class computes exactly, naming the Megatron flag."""
    return CkptError(f"cannot export to Hugging Face: the model uses {flag}, {why}",
                     "no transformers architecture computes this exactly; keep it in Megatron format")


@dataclass(frozen=True)
class Names:
    """One HF class's tensor names: the global ones, one layer's (under layer_prefix, `{i}` the layer)
    and an MoE layer's own (router, experts `{e}`, shared expert).

    bare_prefix: a prefix some checkpoints leave off the global and layer names (GPT2Model saves and
    the original openai-community/gpt2 files omit "transformer."); names outside it stay as they are."""
    globals: Dict[str, Entry]
    layer: Dict[str, Entry]
    layer_prefix: str
    moe: Dict[str, Entry] = field(default_factory=dict)
    bare_prefix: str = ""
    # multi-token prediction (families/mtp.py): an MTP layer's own names (under layer_prefix at its global index)
    # and its names that copy a main-model tensor (layer-relative name -> that canonical global)
    mtp: Dict[str, Entry] = field(default_factory=dict)
    mtp_shared: Dict[str, str] = field(default_factory=dict)

    @property
    def word_embedding(self) -> str:
        return next(k for k, e in self.globals.items() if e == ("copy", "embed.word"))

    def with_full_names(self, entries: dict) -> dict:
        """entries keyed by full names: bare_prefix put back where a checkpoint left it off."""
        p = self.bare_prefix
        if not p or any(k.startswith(p) for k in entries):
            return entries
        outside = tuple({n.split(".")[0] + "." for n in self.globals if not n.startswith(p)})
        return {(k if k.startswith(outside) else p + k): v for k, v in entries.items()}

    def _moe_rows(self, num_experts: int) -> Iterator[Tuple[str, Entry]]:
        """The MoE table with its {e} axis expanded to experts 0 .. num_experts - 1."""
        for k, entry in self.moe.items():
            for e in range(num_experts) if "{e}" in k else (None,):
                yield k.replace("{e}", str(e)), entry if e is None else (entry[0], entry[1].replace("{e}", str(e)))

    def expand(self, num_layers: int, num_experts: int = 0, mtp_layers: int = 0) -> List[Tuple[str, Entry, str]]:
        """[(hf_name, entry, group)] for every possible tensor, in streaming order; the MTP layers (mtp_layers of
        them, after the num_layers decoder layers) with their own names too, and their copies of main-model
        tensors as ("same", canonical global) entries."""
        heads = [k for k in self.globals if canonical_names(self.globals[k])[0].startswith("embed.")]
        out = [(k, self.globals[k], "embed") for k in heads]
        for i in range(num_layers + mtp_layers):
            own = list(self.mtp.items()) if i >= num_layers else []
            for k, (op, arg) in own + list(self.layer.items()) + list(self._moe_rows(num_experts)):
                if op in STACKED:  # every expert's parts, expert by expert
                    arg = tuple(a.format(e=e) for e in range(num_experts) for a in arg)
                arg = tuple(f"layers.{i}.{a}" for a in arg) if isinstance(arg, tuple) else f"layers.{i}.{arg}"
                out.append((self.layer_prefix.format(i=i) + k, (op, arg), f"layer {i}"))
            out += [(self.layer_prefix.format(i=i) + k, ("same", g), f"layer {i}")
                    for k, g in self.mtp_shared.items() if i >= num_layers]
        out += [(k, self.globals[k], "head") for k in self.globals if k not in heads]
        return out


def _never(cfg: GPTConfig) -> bool:
    return False


def _no_checks(cfg: GPTConfig) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One HF model class ckptool reads and (when config_json is set) writes. Adding a family with
    no new maths is one such record in a module of families/ and its line in families/__init__.py.

    config_from_hf(family, config.json, embedding rows) -> GPTConfig, CkptError for values it cannot
    convert; config_json(family, cfg, vocab) -> config.json (the writer adds token ids and dtype).
    Export: the registry (families/__init__.py for_config) sorts a GPTConfig into an export kind
    ("learned", "mla", "moe", "gemma", "dense"); the family of that kind whose selects(cfg) holds is the class
    written, after its export_checks(cfg) (CkptError via refuse_export for what the class cannot compute).
    """
    model_type: str
    architecture: str
    names: Names
    config_from_hf: Callable[["Family", dict, int], GPTConfig]
    config_json: Optional[Callable[["Family", GPTConfig, int], dict]] = None  # None: read only
    export_kind: Optional[str] = None
    selects: Callable[[GPTConfig], bool] = _never
    export_checks: Callable[[GPTConfig], None] = _no_checks
    # transformers >= 5 holds a layer's experts fused (what a raw state_dict holds); per layer suffix:
    #   ("halves", (a, b))  [E, 2I, h]: rows [:I] of expert e are Hub name a, rows [I:] are b
    #   ("each", a)         [E, ...]: expert e's slice is Hub name a
    #   ("rename", a)       the same tensor under Hub name a
    fused_experts: Dict[str, Entry] = field(default_factory=dict)
    # maths flags config.json does not spell out (read by the shared Llama-style reader, llama.py)
    qkv_bias_only: bool = False  # biases on q, k and v only (Qwen2; Qwen2-MoE's config qkv_bias, default on)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # --- GLM-4.5 (Glm4Moe) --------------------------------------------------------------------------
    # qkv_bias_key: (config.json key, its default) saying whether q, k, v have biases, for qkv_bias_only classes
    # (Qwen2-MoE: qkv_bias, on; GLM-4.5: attention_bias, off); qk_norm_key: the key that turns q/k norms on (GLM's
    # use_qk_norm), where the class has them optionally; partial_rotary: the class's partial_rotary_factor default
    # (GLM: 0.5, transformers' Glm4MoeConfig.__post_init__), None where the class rotates whole heads and config.json's
    # factor is not read; export refuses --rotary-percent below 1 for such a class
    qkv_bias_key: Tuple[str, bool] = ("qkv_bias", True)
    qk_norm_key: Optional[str] = None
    partial_rotary: Optional[float] = None
    mla: Optional[Callable[[dict, str], object]] = None  # Multi-Latent Attention's sizes from config.json (DeepSeek-V3); YaRN read with it
    moe: Optional["MoeKeys"] = None  # where config.json keeps the routing facts
    zero_biases: bool = False  # the class always has linear biases: a bias-free model exports zero ones
    sliding_window_default: bool = False  # config.json's use_sliding_window when it does not say
    zero_centred_norms: bool = False  # the class stores norm weights w and computes (1 + w), as --apply-layernorm-1p (Gemma)
    softcap_defaults: Tuple[Optional[float], Optional[float]] = (None, None)  # (attention, final) when config.json omits them (Gemma 2: 50, 30)
    spec: str = "gpt"  # the canonical tensors' spec (spec/__init__.py FAMILIES)
    # --- block FP8 (issue 30, fp8) ---
    # the layer-table keys (Names.layer / Names.moe, `{e}` an expert) the family's releases store as
    # block FP8 (formats/hf/quant.py); to-hf --fp8 quantizes these and is refused for a family without any
    fp8_release: Tuple[str, ...] = ()
    mtp_key: Optional[str] = None  # config.json's number of MTP layers (families/mtp.py); None: the class has none

    def read_config(self, conf: dict, rows: int) -> GPTConfig:
        return self.config_from_hf(self, conf, rows)

    def write_config(self, cfg: GPTConfig, vocab: int) -> dict:
        return self.config_json(self, cfg, vocab)
