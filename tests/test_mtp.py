"""Multi-token prediction (MTP) layers both ways: a tiny DeepSeek-V3 made "as released" (its MTP layer's tensors
added to what transformers saves, named as DeepSeek-V3's model.safetensors.index.json names model.layers.61:
the decoder layer, enorm, hnorm, eh_proj, shared_head.norm and the copies of embed_tokens and shared_head.head)
read, converted through Megatron and back bit-exact; transformers loads the main model (its logits equal) and its
MtpModel loads the MTP layer strictly (modeling_layers.py: it raises on a missing MTP weight)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from test_moe import COMMON, _one_line_refusal, cli, hf_logits, randomise, saved_tensors, transformers  # noqa: F401

from ckptool.formats.registry import open_checkpoint

LAYERS = 3  # layer 0 dense, 1-2 MoE; the MTP layer is model.layers.3 (MoE, like the release's layer 61)
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _deepseek_config(layers: int, mtp: int):
    return transformers.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
        kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        num_nextn_predict_layers=mtp)


def as_released(path: Path, seed: int = 41) -> Path:
    """A DeepSeek-V3 directory as DeepSeek releases one: the main model (LAYERS layers, saved by transformers, which
    leaves MTP layers out) and one MTP layer, model.layers.LAYERS.*: a decoder layer (a fifth layer of a model built
    one layer deeper, so its shapes and names are transformers' own), its own norms and projection (off init), and
    its copies of the embedding and the head. config.json declares num_nextn_predict_layers = 1."""
    torch.manual_seed(seed)
    deeper = randomise(transformers.DeepseekV3ForCausalLM(_deepseek_config(LAYERS + 1, 0))).eval()
    model = transformers.DeepseekV3ForCausalLM(_deepseek_config(LAYERS, 1)).eval()
    model.load_state_dict({k: v for k, v in deeper.state_dict().items()
                           if not k.startswith(f"model.layers.{LAYERS}.")}, strict=True)
    model.save_pretrained(path)
    deeper.save_pretrained(path.with_name(path.name + "_deeper"))  # the Hub's names (per-expert), as released
    sd = saved_tensors(path.with_name(path.name + "_deeper"))
    mtp = {k: v.clone() for k, v in sd.items() if k.startswith(f"model.layers.{LAYERS}.")}
    pre, h = f"model.layers.{LAYERS}.", COMMON["hidden_size"]
    mtp.update({pre + "enorm.weight": torch.rand(h) + 0.5, pre + "hnorm.weight": torch.rand(h) + 0.5,
                pre + "shared_head.norm.weight": torch.rand(h) + 0.5, pre + "eh_proj.weight": torch.randn(h, 2 * h) * 0.15,
                pre + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
                pre + "shared_head.head.weight": sd["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / "model-mtp.safetensors"))
    main_file = path / "model.safetensors"
    index = {"metadata": {}, "weight_map": {**{k: main_file.name for k in saved_tensors_of(main_file)},
                                            **{k: "model-mtp.safetensors" for k in mtp}}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def saved_tensors_of(f: Path):
    from safetensors import safe_open
    with safe_open(str(f), framework="pt") as s:
        return list(s.keys())


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return as_released(tmp_path_factory.mktemp("mtp") / "deepseek_v3_mtp")


def mtp_model(path: Path):
    """transformers' own MTP module for the model at path (MtpModel.from_pretrained: raises on a missing MTP
    weight), with the main model it ties to."""
    from transformers.modeling_layers import MtpModel
    main = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    # MtpModel finds the MTP keys by the class's _keys_to_ignore_on_load_unexpected, which names the release's
    # layer 61: the tiny model's MTP layer is layer LAYERS
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}.*"]
    return main, MtpModel.from_pretrained(main)


def test_released_mtp_layer_is_read_and_written_back_bit_exact(released, tmp_path):
    """from the released form: inspect names the MTP layer; to-hf through Megatron (EP 2) writes every tensor back
    bit-exact, the MTP layer's included, and transformers' MtpModel loads it."""
    ckpt = open_checkpoint(released)
    assert ckpt.config.mtp_num_layers == 1 and ckpt.config.num_layers == LAYERS
    assert f"layers.{LAYERS}.mtp.eh_proj.weight" in ckpt.tensors and ckpt.config.is_moe_layer(LAYERS)
    cli("from-hf", released, tmp_path / "meg", "--ep", 2)
    cli("to-hf", tmp_path / "meg", tmp_path / "hf")
    want, got = saved_tensors(released), saved_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(released))
    _, mtp = mtp_model(tmp_path / "hf")
    layer = mtp.layers[0]
    assert torch.equal(layer.eh_proj.weight, want[f"model.layers.{LAYERS}.eh_proj.weight"])
    assert torch.equal(layer.post_norm.weight, want[f"model.layers.{LAYERS}.shared_head.norm.weight"])
    assert torch.equal(layer.mtp_block.self_attn.kv_b_proj.weight,
                       want[f"model.layers.{LAYERS}.self_attn.kv_b_proj.weight"])
