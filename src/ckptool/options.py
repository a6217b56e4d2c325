"""What a user can tell a reader that the checkpoint itself may not say."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .errors import CkptError


@dataclass
class ReadOptions:
    iteration: Optional[int] = None  # which iter_XXXXXXX (default: the tracker's / the latest)
    true_vocab_size: Optional[int] = None
    replicas: str = "first"  # first | mean | strict: TP replicas that differ
    weights: Optional[str] = None  # DeepSpeed: master (fp32 optimizer) | model (16-bit module)
    qkv_layout: Optional[str] = None  # Megatron-DeepSpeed QKV packing when the files cannot tell
    hf_config: Optional[str] = None
    args_from: Optional[str] = None  # take missing args from another checkpoint
    optimizer: bool = True  # False (--no-optimizer): leave the optimizer state unread, even a broken one
    # Architecture facts for checkpoints that store no args (2019 files, bare DCP saves):
    overrides: Dict[str, Any] = field(default_factory=dict)

    def config_overrides(self) -> Dict[str, Any]:
        """The overrides a reader applies to the GPTConfig it built (GPTConfig field names)."""
        return {k: v for k, v in self.overrides.items() if v is not None and k in CONFIG_OVERRIDES}


# GPTConfig fields a user's override replaces in what the checkpoint's args or shapes say.
CONFIG_OVERRIDES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                    "max_position_embeddings", "activation", "normalization", "norm_eps", "position_embedding",
                    "rotary_base", "make_vocab_size_divisible_by", "head_dim")


# The reading options by their CLI names (--num-attention-heads -> num_attention_heads). The first group
# are ReadOptions fields; the second are architecture facts that go to ReadOptions.overrides.
READ_FIELDS = ("iteration", "true_vocab_size", "replicas", "weights", "qkv_layout", "hf_config", "args_from")
OVERRIDE_FIELDS = ("num_attention_heads", "num_query_groups", "activation", "num_layers", "hidden_size",
                   "ffn_hidden_size", "max_position_embeddings", "vocab_size", "normalization", "rotary_base")
READ_OPTION_NAMES = READ_FIELDS + OVERRIDE_FIELDS

# Options whose value is one of a few words (the CLI's click.Choice lists and the API's checks).
CHOICES = {
    "replicas": ("first", "mean", "strict"),
    "weights": ("master", "model"),
    "qkv_layout": ("grouped", "split"),
    "activation": ("gelu", "gelu_tanh", "swiglu", "squared_relu"),
    "normalization": ("layernorm", "rmsnorm"),
    "compute_dtype": ("fp32", "bf16", "fp16"),  # verify's --dtype (verify/run.COMPUTE_DTYPES)
}


def check_choice(name: str, value) -> None:
    """CkptError unless value is None or one of CHOICES[name] (what click.Choice does for the CLI)."""
    allowed = CHOICES.get(name)
    if value is not None and allowed is not None and value not in allowed:
        raise CkptError(f"unknown {name} {value!r}", f"choose one of {', '.join(allowed)}")


def pop_read_options(kw: dict) -> ReadOptions:
    """Take the reading options (CLI names, snake_case) out of kw and build ReadOptions. None means
    "not given"; what is left in kw is for the caller."""
    given = {k: kw.pop(k) for k in READ_OPTION_NAMES if k in kw}
    for k, v in given.items():
        check_choice(k, v)
    fields = {k: given[k] for k in READ_FIELDS if given.get(k) is not None}
    overrides = {k: given[k] for k in OVERRIDE_FIELDS if given.get(k) is not None}
    return ReadOptions(**fields, overrides=overrides)
