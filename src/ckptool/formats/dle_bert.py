"""NVIDIA DeepLearningExamples BERT pretraining checkpoints (ckpt_N.pt) -> transformers BertForPreTraining.

Facts (DeepLearningExamples PyTorch/LanguageModeling/BERT, modeling.py and run_pretraining.py):
- ckpt_N.pt is a torch.save'd dict whose `model` is the state dict of DLE's BertForPreTraining
  (other keys: optimizer, master params, files, ...; ignored here).
- Names equal transformers' BertForPreTraining except that the three Linear+activation modules are
  DLE's LinearActivation called `dense_act` (intermediate, pooler, cls.predictions.transform),
  where transformers says `dense`. Old TF-era files name LayerNorm parameters gamma/beta.
- run_pretraining pads config.vocab_size up to a multiple of 8 at run time (30522 -> 30528) while
  bert_config.json keeps the true size, so word embeddings, the tied decoder and the MLM bias
  carry padding rows that the export trims.
- cls.predictions.decoder.weight is the word embedding (tied); transformers ties it itself.
- DLE's bias_gelu is the erf GeLU, transformers' "gelu".
BERT is not a GPT, so this is a direct renaming pass, not a reader of the canonical GPT state, and
it is never resharded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..errors import CkptError, NoCanonicalForm, require
from ..io.safetensors_writer import Item, parse_size, write_sharded
from ..io.torchfile import load_torch_file
from ..lazy import LazyTensor
from ..summary import WriteSummary, from_sharded
from .hf.writer import config_dtype

WORD = "bert.embeddings.word_embeddings.weight"
# DLE name fragment -> transformers name fragment
RENAMES = ((".dense_act.", ".dense."), ("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))
VOCAB_ROWS = (WORD, "cls.predictions.bias")  # tensors with one row per vocabulary entry
DROPPED = ("cls.predictions.decoder.weight",)  # tied to WORD; transformers re-ties it
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
               "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
               "type_vocab_size", "initializer_range")
ACTIVATIONS = {"gelu": "gelu", "bias_gelu": "gelu", "relu": "relu", "bias_relu": "relu", "tanh": "tanh",
               "bias_tanh": "tanh", "swish": "swish"}


def _state(path: Path) -> Dict[str, LazyTensor]:
    tree = load_torch_file(path)
    model = tree.get("model") if isinstance(tree, dict) else None
    require(isinstance(model, dict), f"{path}: no `model` state dict (not a DeepLearningExamples BERT ckpt_N.pt)")
    out = {}
    for k, v in model.items():
        if isinstance(v, LazyTensor):
            out[k[len("module."):] if k.startswith("module.") else k] = v
    return out


def looks_like(path) -> bool:
    path = Path(path)
    if not path.is_file() or path.suffix not in (".pt", ".pth", ".bin"):
        return False
    try:
        return WORD in _state(path)
    except Exception:
        return False


def read(path: Path, opts) -> None:
    """The format table's reader: BERT has no canonical GPT form, so every command but to-hf refuses
    it; to-hf calls the error's export (write_hf_bert with --hf-config)."""
    def export(out_dir, dtype=None, max_shard_size="5GB", progress=None) -> WriteSummary:
        require(opts.hf_config is not None, f"{path} is a DeepLearningExamples BERT checkpoint, which stores no config",
                "pass --hf-config bert_config.json (the file the run trained with)")
        return write_hf_bert(Path(path), opts.hf_config, out_dir, dtype=dtype, max_shard_size=max_shard_size,
                             progress=progress)
    raise NoCanonicalForm(f"{path} is a DeepLearningExamples BERT checkpoint, not a GPT ckptool can reshard",
                          "use `ckptool to-hf SRC DST --hf-config bert_config.json` to export it as BertForPreTraining",
                          kind="bert", exports={"hf": export})


def hf_name(dle: str) -> str:
    for a, b in RENAMES:
        dle = dle.replace(a, b)
    return dle


def bert_hf_config(dle_conf: dict, vocab: int, dtype: torch.dtype) -> dict:
    missing = [k for k in CONFIG_KEYS if k not in dle_conf]
    require(not missing, f"--hf-config lacks {', '.join(missing)}", "pass the bert_config.json the run trained with")
    act = dle_conf["hidden_act"]
    require(act in ACTIVATIONS, f"BERT hidden_act {act!r} is not one ckptool maps",
            f"supported: {', '.join(ACTIVATIONS)}")
    conf = {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": vocab,
            **{k: dle_conf[k] for k in CONFIG_KEYS}, "hidden_act": ACTIVATIONS[act],
            "layer_norm_eps": 1e-12,  # DLE's BertLayerNorm is built with eps=1e-12 everywhere
            "pad_token_id": dle_conf.get("pad_token_id", 0), "position_embedding_type": "absolute",
            "tie_word_embeddings": True}
    conf["dtype"] = conf["torch_dtype"] = config_dtype(dtype)
    return conf


def write_hf_bert(src: Path, hf_config: str, out_dir: Path, dtype: Optional[torch.dtype] = None,
                  max_shard_size="5GB", progress: Optional[Callable[[int], None]] = None) -> WriteSummary:
    try:
        dle_conf = json.loads(Path(hf_config).read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"--hf-config {hf_config}: not a readable JSON file ({e})")
    state = _state(Path(src))
    require(WORD in state, f"{src}: no {WORD}: not a BERT pretraining checkpoint")
    rows = state[WORD].shape[0]
    vocab = int(dle_conf.get("vocab_size", rows))
    require(vocab <= rows, f"--hf-config says vocab_size {vocab} but the checkpoint has only {rows} embedding rows",
            "pass the bert_config.json this checkpoint was trained with")
    items: List[Item] = []
    for k, t in state.items():
        if k in DROPPED:
            continue
        if k in VOCAB_ROWS:
            t = t.narrow(0, 0, vocab)
        if dtype is not None:
            t = t.to(dtype)
        items.append((hf_name(k), t, "all"))
    names = [n for n, _, _ in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    require(not dup, f"{src}: several tensors map to {', '.join(dup[:3])}")
    out_dir = Path(out_dir)
    written = write_sharded(out_dir, items, parse_size(max_shard_size), progress)
    out_dtype = dtype or items[0][1].dtype
    (out_dir / "config.json").write_text(json.dumps(bert_hf_config(dle_conf, vocab, out_dtype), indent=2) + "\n")
    return from_sharded("hf", written, tensors=len(items), architecture="BertForPreTraining", vocab_size=vocab,
                        padded_rows=rows, dtype=config_dtype(out_dtype))
