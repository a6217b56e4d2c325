"""torch.distributed.checkpoint folders written by FSDP / FSDP2 trainers, on disk, without torch: whether a
path is one, where its DCP folder and its model's config.json are, and under which prefix its model keys sit.

Such a folder is a plain DCP save (`.metadata` + `__R_N.distcp`, no megatron-core metadata.json or common
state) of a model's state dict under Hugging Face parameter names or torchtitan's own:
  - torchtitan (torchtitan/components/checkpoint.py, CheckpointManager._flattened_model_states_sd): the model
    state at the top level (keys are the model's FQNs), the optimizer under "optimizer", in folders
    `checkpoint/step-N/`;
  - accelerate's save_fsdp_model with SHARDED_STATE_DICT (src/accelerate/utils/fsdp_utils.py at
    00b1b18): `{"model": state_dict}` into `<output_dir>/pytorch_model_fsdp_0/` -> keys "model.<fqn>";
  - NeMo-RL / others: `{"model": ..., "optimizer": ...}` (the same "model." prefix).
The word embedding tells the prefix and the names (HF families' or torchtitan's). Its config is a Hugging
Face config.json: --hf-config, else beside the folder, in its huggingface/ subfolder, or in the parent's
(torchtitan and verl keep the HF assets in a huggingface/ folder of the run).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional, Tuple

from ... import families
from ...errors import CkptError
from ...quick.torch_pickle import NotQuick, loads
from .files import COMMON_FILE, CONFIG_FILE, DCP_METADATA

FORMAT = "dcp"
DIALECTS = ("hf", "torchtitan")  # the names the dcp writer writes (--dialect; hf by default)
# prefixes a trainer's state dict puts before the model's own FQNs (accelerate / NeMo-RL: "model.")
MODEL_PREFIXES = ("", "model.", "module.", "model.module.")
TITAN_WORD = "tok_embeddings.weight"  # torchtitan's word embedding (its models' own names)
ACCELERATE_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
STEP_DIR = re.compile(r"^step-(\d+)$")  # torchtitan's checkpoint folders
DATA_FILES = "__*_*.distcp"  # DCP's data files (FileSystemWriter)
OPTIMIZER_PREFIXES = ("optimizer.", "optim.")  # where trainers keep the optimizer beside the model
# top-level trainer states beside a torchtitan model (CheckpointManager's states): never model tensors
TRAINER_STATES = OPTIMIZER_PREFIXES + ("lr_scheduler", "dataloader", "train_state")
CONFIG_PLACES = ("config.json", "huggingface/config.json", "../config.json", "../huggingface/config.json")


def word_embeddings() -> Tuple[Tuple[str, str], ...]:
    """(dialect, word-embedding key) of every name scheme read: each HF family's, then torchtitan's."""
    hf = tuple(dict.fromkeys(("hf", f.names.word_embedding) for f in families.FAMILIES))
    return hf + (("torchtitan", TITAN_WORD),)


def _dcp_keys(d: Path) -> Optional[List[str]]:
    """The entry names of d's DCP index, read without torch; None if it is not one quick reading can open."""
    try:
        meta = loads((d / DCP_METADATA).read_bytes())
        return [k for k in getattr(meta, "state_dict_metadata", {}) if isinstance(k, str)]
    except (NotQuick, OSError, ValueError, TypeError, AttributeError, EOFError, IndexError, KeyError):
        return None


def name_scheme(keys: List[str]) -> Optional[Tuple[str, str]]:
    """(dialect "hf" / "torchtitan", model-key prefix) of a DCP's entries, None if no word embedding names one."""
    present = set(keys)
    for prefix in MODEL_PREFIXES:
        for dialect, word in word_embeddings():
            if prefix + word in present:
                return dialect, prefix
    return None


def model_name(key: str, prefix: str) -> Optional[str]:
    """The model's own name of a DCP key under a model-key prefix, None for keys outside the model (another
    prefix; at the top level, a trainer state such as the optimizer)."""
    if not key.startswith(prefix) or (not prefix and key.startswith(TRAINER_STATES)):
        return None
    return key[len(prefix):]


def locate(path: Path, step: Optional[int] = None) -> Path:
    """The DCP folder of a path: the folder itself, accelerate's pytorch_model_fsdp_0/ inside an output
    dir, or torchtitan's step-N/ inside a checkpoint dir (the highest N, or `step` when given)."""
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        return path
    if not path.is_dir():
        raise CkptError(f"{path}: not a directory")
    accelerate = sorted(p for p in path.iterdir() if ACCELERATE_DIR.match(p.name) and (p / DCP_METADATA).is_file())
    if accelerate:
        return accelerate[0]
    steps = {int(m.group(1)): p for p in path.iterdir() if (m := STEP_DIR.match(p.name)) and (p / DCP_METADATA).is_file()}
    if steps:
        if step is not None and step not in steps:
            raise CkptError(f"{path}: no step-{step}/ (found steps {sorted(steps)})", "pass one of those steps")
        return steps[step if step is not None else max(steps)]
    orphan = _data_without_index(path)
    if orphan is not None:
        raise CkptError(f"{orphan}: DCP data files ({', '.join(sorted(p.name for p in orphan.glob(DATA_FILES))[:3])}) "
                        f"but no {DCP_METADATA} index", "the save was interrupted, or .metadata was not copied: copy "
                        "the whole folder again (no reader can place the chunks without it)")
    raise CkptError(f"{path}: no torch.distributed.checkpoint folder (.metadata) here",
                    "pass the folder the trainer saved (step-N/, pytorch_model_fsdp_0/)")


def _data_without_index(path: Path) -> Optional[Path]:
    """The folder (path, or accelerate's model folder in it) holding DCP data files but no .metadata, else None."""
    for d in [path] + sorted(p for p in path.iterdir() if ACCELERATE_DIR.match(p.name) and p.is_dir()):
        if not (d / DCP_METADATA).exists() and not (d / CONFIG_FILE).exists() and any(d.glob(DATA_FILES)):
            return d
    return None


def looks_like(path: Path) -> bool:
    """A plain DCP save whose model keys are a Hugging Face family's or torchtitan's (megatron-core's
    torch_dist has metadata.json / a common state and its own names: formats/dcp/files.py); also DCP data
    files left without their index, for the reader to say so."""
    path = Path(path)
    if path.is_dir() and _data_without_index(path) is not None:
        return True
    try:
        d = locate(path)
    except CkptError:
        return False
    if (d / CONFIG_FILE).is_file() or (d / COMMON_FILE).is_file():
        return False
    keys = _dcp_keys(d)
    return keys is not None and name_scheme(keys) is not None


def find_config(d: Path, given: Optional[str]) -> Tuple[dict, Path]:
    """(config.json, where it was) of the model saved in DCP folder d: --hf-config (a file or a folder
    holding one), else the first of CONFIG_PLACES around d; CkptError naming the places looked at."""
    if given:
        g = Path(given)
        candidates = [g / "config.json" if g.is_dir() else g]
        if not candidates[0].is_file():
            raise CkptError(f"--hf-config {given}: no config.json there", "pass a config.json or a folder holding one")
    else:
        candidates = [d / place for place in CONFIG_PLACES]
    for c in candidates:
        if c.is_file():
            try:
                return json.loads(c.read_text()), c.resolve()
            except ValueError as e:
                raise CkptError(f"{c}: not valid JSON ({e})", "pass a Hugging Face config.json")
    looked = ", ".join(str(c) for c in candidates)
    raise CkptError(f"{d}: a DCP save of a Hugging Face-named model without its config.json (looked at {looked})",
                    "give --hf-config DIR, the folder holding the model's config.json")
