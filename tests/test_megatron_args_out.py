"""The args ckptool writes into Megatron outputs: what Megatron-LM's argument code needs of them, and the
true vocabulary they say (the NullTokenizer's two eras, --true-vocab-size carried).

The real checkpoints are the two eras of Megatron-LM's NullTokenizer: both ran --vocab-size 1001, the
legacy run at 67f3515c (2026-01, before c9dfe34: 1002 tokens, EOD 1001), the mcore run at d98e8a64
(2026-08: 1001 tokens). Their args differ by the fields c9dfe34 introduced (null_tokenizer_eod_id /
null_tokenizer_pad_id), which the legacy run's args lack."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptool
from conftest import REAL_TRUE_VOCAB, ROOT, real_checkpoint
from ckptool.formats.megatron.args import VALIDATE_ARGS_REQUIRED, config_from_args
from ckptool.io.torchfile import load_torch_file

transformers = pytest.importorskip("transformers")

NEW_ERA, OLD_ERA = "mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"
# where the conditional check finds Megatron-LM's source: env MEGATRON_LM, else a checkout beside shared/
MEGATRON_LM = Path(os.environ.get("MEGATRON_LM") or ROOT.parent / "shared" / "Megatron-LM")


def written_args(ckpt_dir: Path) -> argparse.Namespace:
    first = sorted(Path(ckpt_dir).rglob("model_optim_rng.pt"))[0]
    return load_torch_file(first)["args"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """A tiny GPT-2 and a tiny Llama built with transformers (no tokenizer files: from-hf has only config.json)."""
    root = tmp_path_factory.mktemp("hf_args")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=1000, n_positions=64,
                                   layer_norm_epsilon=1e-6)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, vocab_size=1000, max_position_embeddings=128,
                                     rms_norm_eps=1e-6, rope_theta=50000.0)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    for name in ("gpt2", "llama"):
        ckptool.from_hf(root / name, root / f"{name}_mlm")
    return root


@pytest.mark.parametrize("name, positions", [("gpt2", 64), ("llama", 128)])
def test_from_hf_args_hold_every_field_validate_args_needs(hf_models, name, positions):
    """Each field of VALIDATE_ARGS_REQUIRED (Megatron-LM d98e8a64, file:line there) is set, with the values
    the HF config gives: e50c766 wrote 38 fields, without seq_length and tokenizer_type."""
    args = written_args(hf_models / f"{name}_mlm")
    assert [f for f, _ in VALIDATE_ARGS_REQUIRED if getattr(args, f, None) is None] == []
    assert args.seq_length == args.encoder_seq_length == args.max_position_embeddings == positions
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == ("NullTokenizer", 1000, 1024)
    assert args.norm_epsilon == pytest.approx(1e-6) and (args.fp16, args.bf16) == (False, False)
    if name == "llama":
        assert (args.rotary_base, args.swiglu, args.num_query_groups) == (50000.0, True, 2)
    # read back: the current NullTokenizer's vocab_size tokens, not one more
    back = ckptool.open(hf_models / f"{name}_mlm")
    assert (back.config.vocab_size, back.config.vocab_size_source) == (1000, "args.vocab_size")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def test_megatron_lm_validate_args_accepts_the_outputs(hf_models, tmp_path):
    """scripts/mlm_args_check.py: Megatron-LM's own parse_args + load_args_from_checkpoint + validate_args on
    from-hf outputs (GPT-2, Llama) and merges of the two real checkpoints."""
    if not (MEGATRON_LM / "megatron" / "training" / "arguments.py").is_file():
        pytest.skip(f"no Megatron-LM checkout at {MEGATRON_LM} (set MEGATRON_LM to one, e.g. d98e8a64)")
    if not _triton_importable():
        pytest.skip("Megatron-LM's megatron.core imports triton at module level; it is not importable here")
    merged = []
    for case in (NEW_ERA, OLD_ERA):
        ckptool.merge(real_checkpoint(case) / "checkpoint", tmp_path / case, optimizer=False)
        merged.append(tmp_path / case)
    env = dict(os.environ, MEGATRON_LM=str(MEGATRON_LM))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mlm_args_check.py"), str(hf_models / "gpt2_mlm"),
                        str(hf_models / "llama_mlm"), *map(str, merged)], capture_output=True, text=True, env=env,
                       timeout=300)
    verdicts = [line for line in r.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert r.returncode == 0 and len(verdicts) == 4 and all(v.startswith("ok ") for v in verdicts), \
        r.stdout[-3000:] + r.stderr[-3000:]


def _null_args(**era) -> argparse.Namespace:
    return argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, tokenizer_type="NullTokenizer",
                              vocab_size=1000, padded_vocab_size=1024, make_vocab_size_divisible_by=128, **era)


def test_null_tokenizer_era_from_the_args():
    """Before Megatron-LM c9dfe34 the NullTokenizer had vocab_size + 1 tokens; its args lack the fields
    that commit added. A true vocabulary beyond the stored rows is not believed, as before."""
    old = config_from_args(_null_args(), 1024)
    assert old.vocab_size == 1001 and "c9dfe34" in old.vocab_size_source
    new = config_from_args(_null_args(null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1), 1024)
    assert (new.vocab_size, new.vocab_size_source) == (1000, "args.vocab_size")
    assert config_from_args(_null_args(), 1000).vocab_size is None


def _rows_through(case: str, tmp_path: Path, **read):
    """(the merged checkpoint's true vocab, its args' vocab_size, the to-hf model's vocab and word embedding)."""
    src = real_checkpoint(case) / "checkpoint"
    ckptool.merge(src, tmp_path / "merged", optimizer=False, **read)
    merged = ckptool.open(tmp_path / "merged")
    ckptool.to_hf(tmp_path / "merged", tmp_path / "hf", dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    word = model.get_input_embeddings().weight.detach()
    return merged.config.vocab_size, written_args(tmp_path / "merged").vocab_size, model.config.vocab_size, word


@pytest.mark.parametrize("case", [OLD_ERA, NEW_ERA])
def test_null_tokenizer_rows_kept_through_merge_and_to_hf(case, tmp_path):
    """The old-era run keeps its EOD row 1001 (e50c766 cut it at to-hf); the new-era run has 1001 rows."""
    true_vocab, args_vocab, hf_vocab, word = _rows_through(case, tmp_path)
    assert true_vocab == hf_vocab == word.shape[0] == REAL_TRUE_VOCAB[case]
    assert args_vocab == 1001  # the run's --vocab-size, kept in its era's terms
    source = ckptool.open(real_checkpoint(case) / "checkpoint").tensors["embed.word"].load()
    assert torch.equal(word, source[:REAL_TRUE_VOCAB[case]].float())


@pytest.mark.parametrize("case, args_vocab", [(NEW_ERA, 1010), (OLD_ERA, 1009)])
def test_true_vocab_size_is_carried_into_the_written_args(case, args_vocab, tmp_path):
    """merge --true-vocab-size 1010: the output's args say 1010 to a reader without the flag (the old-era
    NullTokenizer's vocab_size one less), and to-hf keeps those 1010 rows; e50c766 kept the source's 1001."""
    true_vocab, written, hf_vocab, word = _rows_through(case, tmp_path, true_vocab_size=1010)
    assert (true_vocab, written, hf_vocab, word.shape[0]) == (1010, args_vocab, 1010, 1010)
    source = ckptool.open(real_checkpoint(case) / "checkpoint").tensors["embed.word"].load()
    assert torch.equal(word, source[:1010].float())
