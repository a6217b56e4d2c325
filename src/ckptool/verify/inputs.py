"""What verify compares against, and on which tokens.

A reference is one of
  a checkpoint ckptool reads      -> the one-process reference forward (reference.py)
  a Hugging Face model directory  -> transformers' AutoModelForCausalLM (config.json present)
  recorded logits (--reference-logits FILE[:KEY]) -> the tokens and logits the framework computed

Each yields (logits [b, s, V], {"embedding"|"layer i": hidden} or None, true vocab or None).
"""
from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..errors import CkptError, require
from ..lazy import load_scope
from ..state import Checkpoint
from . import reference
from safetensors.torch import load_file
from ..io.torchfile import load_torch_file
from ..formats.hf.reader import has_weights
from ..io import profile, startup
from .maths import ONE_PROCESS, embed


# --- tokens ---------------------------------------------------------------------------------

def parse_token_ids(text: str) -> torch.Tensor:
    rows = [r for r in text.replace("\n", ";").split(";") if r.strip()]
    try:
        ids = [[int(x) for x in r.replace(" ", ",").split(",") if x.strip()] for r in rows]
    except ValueError:
        raise CkptError("--tokens holds something that is not a token id",
                        'write ids like "1,2,3;4,5,6", or pass a text file with --tokenizer DIR')
    require(ids and len({len(r) for r in ids}) == 1 and ids[0],
            "--tokens rows must be non-empty and of equal length", 'e.g. --tokens "1,2,3;4,5,6"')
    return torch.tensor(ids, dtype=torch.long)


DEFAULT_SEQ_LEN = 16


def default_seq_len(seq_len: Optional[int], cfg) -> int:
    """The length of random token rows: as asked, else 16, or past a sliding window when the model has one (Gemma's
    local layers, GPT-OSS's sliding layers): the longer of 16 past the window and twice the window plus 8, so the
    default inputs reach past the window and windowing is exercised."""
    if seq_len is not None:
        return seq_len
    w = cfg.sliding_window
    return DEFAULT_SEQ_LEN if w is None else max(DEFAULT_SEQ_LEN + w, 2 * w + 8)


def make_tokens(tokens: Optional[str], tokenizer: Optional[str], batch: int, seq_len: int, seed: int,
                vocab: int) -> torch.Tensor:
    if tokens is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq_len), generator=g)
    path = Path(tokens)
    if tokenizer:
        require(path.is_file(), f"--tokens {tokens}: no such file", "with --tokenizer, --tokens is a text file")
        with TRANSFORMERS_LOCK:  # see there: the Preload thread may be importing transformers now
            from transformers import AutoTokenizer  # transformers on use (slow to import; only for --prompt / an HF reference)
            tok = AutoTokenizer.from_pretrained(tokenizer)
        lines = [l for l in path.read_text().splitlines() if l.strip()]
        ids = [tok(l)["input_ids"] for l in lines]
        require(lines and min(len(x) for x in ids) > 0, f"{tokens}: no text to tokenize")
        n = min(len(x) for x in ids)
        t = torch.tensor([x[:n] for x in ids], dtype=torch.long)
    else:
        t = parse_token_ids(path.read_text() if path.is_file() else tokens)
    # the parallel embedding zeroes ids outside every rank's rows, so a bad id must stop us here
    require(int(t.max()) < vocab and int(t.min()) >= 0,
            f"--tokens holds id {int(t.max())}, outside the vocabulary of {vocab}",
            "use ids (or a tokenizer) that belong to this model's vocabulary")
    return t


# --- references -----------------------------------------------------------------------------

def checkpoint_forward(ckpt: Checkpoint, tokens: torch.Tensor, dtype, device="cpu"):
    """The one-process forward with the embedding output and every layer's hidden state."""
    logits, layers = reference.forward(ckpt, tokens, dtype, device=device, return_hidden=True)
    with load_scope():  # the embedding's output as the model computes it (maths.embed: Gemma's scaling too)
        w = {k: v.load().to(device=device, dtype=dtype) for k, v in ckpt.tensors.items() if k.startswith("embed.")}
        x = embed(tokens.to(device), w, ckpt.config, ONE_PROCESS)
    hidden = {"embedding": x.float().cpu()}
    hidden.update({f"layer {i}": h for i, h in enumerate(layers)})
    return logits.cpu(), hidden, ckpt.config.vocab_size


def is_hf_dir(path) -> bool:
    """config.json alone is not enough: DeepSpeed runs of HF models keep one beside their shards."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and has_weights(p)


def hf_forward(path, tokens: torch.Tensor, dtype, device="cpu", held: Optional[dict] = None, hidden: bool = True):
    """transformers' own model; its last hidden state is after the final norm, so it is left out.
    held (a dict the caller keeps): the model loaded by an earlier call, reused for an fp32 forward when it
    holds the stored values exactly (see _hf_model), or a Preload made ready while the target ran.
    The logits stay on `device` (the comparison runs there: an 8B model's are 2 GB in fp32, each trip
    to the host and back costs about a second); hidden=False leaves the hidden states out (the noise
    floor's fp32 run needs only the logits)."""
    model = _hf_model(path, dtype, device, held if held is not None else {})
    with torch.no_grad():
        out = model(tokens.to(device), output_hidden_states=hidden)
    states = {}
    if hidden:
        layers = out.hidden_states
        states = {"embedding": layers[0].float().cpu()}
        states.update({f"layer {i}": layers[i + 1].float().cpu() for i in range(len(layers) - 2)})
    return out.logits.float(), states or None, getattr(model.config, "vocab_size", None)


def _hf_model(path, dtype, device, held: dict):
    """The model in dtype on device. A 16-bit verify runs the reference twice (in its dtype, then in fp32 for
    the noise floor): a model loaded in the dtype its files store holds their values exactly, so widening
    it to fp32 in place gives what loading in fp32 would, without reading an 8B model's 16 GB again.
    Narrowing, or a model already rounded to another dtype, loads afresh."""
    preload = held.pop("preload", None)
    model = preload.model(dtype) if preload is not None else None
    if model is None:
        model = held.pop("model", None)
        if model is not None and held.pop("exact", False) and dtype == torch.float32:
            model = model.to(torch.float32)
        else:
            del model
            model = _load_hf(path, dtype, device)
    held.update(model=model, exact=dtype in (torch.float32, _stored_dtype(path)))
    return model


def _load_hf(path, dtype, device):
    # straight onto the GPU where transformers can (its device_map needs accelerate): no host copy of the
    # weights on the way
    onto = {"device_map": device} if torch.device(device).type != "cpu" and _HAS_ACCELERATE else {}
    with TRANSFORMERS_LOCK:  # from_pretrained imports more of transformers as it goes (see there)
        from transformers import AutoModelForCausalLM  # transformers on use (slow to import; only for an HF reference)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **onto)
    return model.to(device).eval()


# transformers imports its parts lazily on first attribute access, and two threads doing so at once can fail
# ("cannot import name 'AutoTokenizer' from 'transformers'", seen with --tokenizer while a Preload thread loaded
# the reference): every use of transformers in this module that may run beside a Preload holds this lock.
TRANSFORMERS_LOCK = threading.Lock()


_HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


class Preload:
    """A transformers reference made ready on a thread while the target is read and run (verify/run.py).

    Importing transformers' model code takes 5-27 s (it imports torch._dynamo; 13-27 s of a first 8B verify
    on a fresh GPU machine, docs/verify.md) and loading an 8B model another several: none of it needs the
    target, so it runs beside the target's read and forward instead of after them. The import starts at
    once; the weights load once load_on(device) names where (after the process group is up), in the dtype
    the first forward asks for. A verify that stops early calls cancel(): the thread then loads nothing
    (it is a daemon: an import under way ends with the process)."""

    def __init__(self, path, dtype):
        self.path, self.dtype = path, dtype
        self._device: Optional[str] = None
        self._go = threading.Event()
        self._result: dict = {}
        self._done = threading.Event()  # ends the read-ahead of the weight files
        self._thread = threading.Thread(target=self._run, name="ckptool-reference", daemon=True)
        self._thread.start()
        _read_weights_ahead(path, self._done)

    def load_on(self, device) -> None:
        self._device = device
        self._go.set()

    def cancel(self) -> None:
        self._done.set()
        self._go.set()

    def model(self, dtype):
        """The loaded model (raising what loading raised), or None when it was loaded in another dtype or
        never asked to load."""
        self._go.set()
        with profile.stage("wait"):
            self._thread.join()
        if "error" in self._result:
            raise self._result.pop("error")
        model = self._result.pop("model", None)
        return model if dtype == self.dtype else None

    def _run(self) -> None:
        with profile.stage("reference-import"):
            _import_ahead(self.path)
        self._go.wait()
        try:
            if self._device is not None:
                with profile.stage("reference-load"):
                    self._result["model"] = _load_hf(self.path, self.dtype, self._device)
        except BaseException as e:  # noqa: B902 -- handed to the main thread, which raises it in model()
            self._result["error"] = e
        finally:
            self._done.set()


def _import_ahead(path) -> None:
    """Import transformers and the modelling module of the reference's family. Best effort: whatever fails
    here fails again, in transformers' own words, when the model loads."""
    try:
        with TRANSFORMERS_LOCK:
            from transformers import AutoConfig, AutoModelForCausalLM  # see Preload: why on a thread
            AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(path)))]
    except Exception:  # noqa: BLE001 -- see the docstring
        pass


def _read_weights_ahead(path, done: threading.Event) -> None:
    """The reference's weight files read into the page cache on a thread of their own (io/startup.readahead:
    small reads that let imports beside them through) from the start, while the target is read too: with
    both cold the disk, not the import, sets the pace, and an 8B model's 16 GB loaded only after the import
    left the disk idle for the first part of the run. Up to half the memory available, and only where
    start-up read-ahead would run (startup.readahead_wanted: cores to spare, CKPTOOL_READAHEAD)."""
    files = sorted(Path(path).glob("*.safetensors")) or sorted(Path(path).glob("*.bin"))
    if not files or not startup.readahead_wanted():
        return
    cap = min(sum(p.stat().st_size for p in files), startup.available_memory() // 2)

    def run() -> None:
        try:
            with profile.stage("reference-readahead"):
                startup.readahead(files, cap, done)
        except OSError:
            pass  # only a hint: transformers reads what it needs anyway

    threading.Thread(target=run, name="ckptool-reference-readahead", daemon=True).start()


def preload(reference, dtype) -> Optional[Preload]:
    """A Preload of an HF-directory reference, else None (a checkpoint reference is read by ckptool itself,
    layer by layer, as the comparison needs it)."""
    return Preload(reference, dtype) if reference is not None and is_hf_dir(reference) else None


def _stored_dtype(path) -> Optional[torch.dtype]:
    """The dtype config.json says the weights are stored in (transformers writes `dtype`, older ones
    `torch_dtype`), or None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def load_reference_logits(spec: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """FILE[:KEY] -> (tokens [b, s], logits [b, s, V]) recorded from the training framework."""
    path, key = spec, "logits"
    if ":" in spec and not Path(spec).exists():
        path, key = spec.rsplit(":", 1)
    p = Path(path)
    require(p.is_file(), f"--reference-logits {path}: no such file")
    if p.suffix == ".safetensors":
        data = load_file(str(p))
    else:
        data = load_torch_file(p)
        require(isinstance(data, dict), f"{path}: expected a dict with 'tokens' and '{key}'")
        data = {k: (v.load() if hasattr(v, "load") else v) for k, v in data.items()}
    for k in ("tokens", key):
        require(k in data and isinstance(data[k], torch.Tensor),
                f"{path} has no tensor {k!r} (it holds {', '.join(map(str, data))})",
                "name the logits key as FILE:KEY")
    tokens, logits = data["tokens"].long(), data[key].float()
    require(tokens.dim() == 2 and logits.dim() == 3 and logits.shape[:2] == tokens.shape,
            f"{path}: tokens {tuple(tokens.shape)} and {key} {tuple(logits.shape)} do not match",
            "expected tokens [B, S] and logits [B, S, V]")
    return tokens, logits
