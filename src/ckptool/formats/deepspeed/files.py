"""DeepSpeed tag directories on disk, without torch: which files a save holds (see deepspeed/zero.py
for what they are) and whether a path is one. The ZeRO reader, the format table and the quick
inspect ask here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...errors import CkptError
from ..megatron.names import KeyMatcher

MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
TAG_DIR = re.compile(r"^(global_step\d+|\d+)$")  # DeepSpeed's default tag; the 2019 engine used the iteration


@dataclass
class TagFiles:
    tag_dir: Path
    model: Dict[int, Path] = field(default_factory=dict)  # mp -> mp_rank_XX_model_states.pt
    zero_model: Dict[Tuple[int, int], Path] = field(default_factory=dict)  # (dp, mp) -> ZeRO-3 model states
    optim: Dict[Tuple[int, int], Path] = field(default_factory=dict)  # (dp, mp) -> optimizer shard
    layers: Dict[Tuple[int, int], Path] = field(default_factory=dict)  # (layer index, tp) -> layer file

    @property
    def mp_ranks(self) -> List[int]:
        return sorted(set(self.model) | {mp for _, mp in self.zero_model})


def scan_tag_dir(d: Path) -> TagFiles:
    tf = TagFiles(d)
    for p in d.iterdir():
        if m := MODEL_RE.match(p.name):
            if m.group(1) is None:
                tf.model[int(m.group(2))] = p
            else:
                tf.zero_model[(int(m.group(1)), int(m.group(2)))] = p
        elif m := OPTIM_RE.match(p.name):
            key = (int(m.group(1)), int(m.group(2)))
            if key in tf.optim:
                raise CkptError(f"{d}: two optimizer shards for DP rank {key[0]}, MP rank {key[1]} "
                                f"({tf.optim[key].name}, {p.name})", "remove the stale shard")
            tf.optim[key] = p
        elif m := LAYER_RE.match(p.name):
            tf.layers[(int(m.group(1)), int(m.group(2) or 0))] = p
    return tf


def has_states(d: Path) -> bool:
    return d.is_dir() and any(MODEL_RE.match(p.name) or LAYER_RE.match(p.name) for p in d.iterdir())


def resolve_tag_dir(path: Path, iteration: Optional[int] = None) -> Path:
    """The directory holding the *_model_states.pt files, for a tag dir or its parent."""
    path = Path(path)
    if not path.is_dir():
        raise CkptError(f"{path}: not a directory", "pass a DeepSpeed save dir or its global_stepN directory")
    if iteration is not None:
        for name in (f"global_step{iteration}", str(iteration)):
            if has_states(path / name):
                return path / name
        raise CkptError(f"{path}: no checkpoint for step {iteration}",
                        f"available: {', '.join(sorted(p.name for p in path.iterdir() if TAG_DIR.match(p.name))) or 'none'}")
    if has_states(path):
        return path
    for tracker in ("latest", "latest_checkpointed_iteration.txt"):
        f = path / tracker
        if f.is_file():
            tag = f.read_text(errors="replace").strip()
            for name in (tag, f"global_step{tag}"):
                if name and has_states(path / name):
                    return path / name
            raise CkptError(f"{f} names {tag[:40]!r}, but {path / tag} holds no model states",
                            "the checkpoint is incomplete; pass --iteration N for a step that exists")
    tags = [p for p in path.iterdir() if TAG_DIR.match(p.name) and has_states(p)]
    if tags:
        return max(tags, key=lambda p: int(re.sub(r"\D", "", p.name)))
    raise CkptError(f"{path}: no DeepSpeed checkpoint here (no `latest` file, no global_step* directory)",
                    "pass the directory given to engine.save_checkpoint, or a global_stepN directory in it")


def looks_like_deepspeed(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        d = resolve_tag_dir(path)
    except CkptError:
        return False
    # A Megatron-LM iter_* directory never holds *_model_states.pt, so this cannot steal those.
    tf = scan_tag_dir(d)
    return bool(tf.model or tf.zero_model or tf.layers)


def megatron_key(name: str) -> str:
    """Dotted parameter names of a nested Megatron model -> the '/' paths megatron_names uses."""
    parts = name.split(".")
    if parts[0] != "language_model":
        return name
    if parts[1] in ("embedding", "output_layer"):
        return "/".join(parts)
    return f"language_model/{parts[1]}/" + ".".join(parts[2:])


def find_hf_config(tag_dir: Path, given: Optional[str]) -> Optional[dict]:
    """The config.json of a Hugging Face model trained under DeepSpeed: --hf-config, else beside the
    tag directory or in the save directory above it (where save_pretrained put it)."""
    candidates = []
    if given:
        g = Path(given)
        candidates.append(g / "config.json" if g.is_dir() else g)
        if not candidates[0].is_file():
            raise CkptError(f"--hf-config {given}: no config.json there", "pass a config.json or a directory holding one")
    candidates += [tag_dir / "config.json", tag_dir.parent / "config.json"]
    for c in candidates:
        if c.is_file():
            try:
                return json.loads(c.read_text())
            except ValueError as e:
                raise CkptError(f"{c}: not valid JSON ({e})", "pass a Hugging Face config.json")
    return None


def looks_megatron(names) -> bool:
    """Whether most parameter names are one Megatron dialect's (the module holds a Megatron model),
    else they are a Hugging Face model's (formats/deepspeed/checkpoint.py's third kind)."""
    from ..megatron.files import detect_dialect  # the name tables: only where a save's names are judged
    keys = [megatron_key(k) for k in names]
    try:
        d = detect_dialect(keys)
    except CkptError:
        return False
    m = KeyMatcher(d)
    return sum(1 for k in keys if m.match(k)) * 2 > len(keys)
