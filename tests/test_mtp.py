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


def _deepseek(layers: int, mtp: int):
    return transformers.DeepseekV3ForCausalLM(_deepseek_config(layers, mtp))


def _glm(layers: int, mtp: int):
    """GLM-4.5 (Glm4Moe): grouped-query attention with partial RoPE, DeepSeek-V3's routing; its MTP layer named as
    DeepSeek-V3's."""
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=True, partial_rotary_factor=0.5,
        num_nextn_predict_layers=mtp))


def as_released(path: Path, seed: int = 41, make=_deepseek) -> Path:
    """A DeepSeek-V3 directory as DeepSeek releases one: the main model (LAYERS layers, saved by transformers, which
    leaves MTP layers out) and one MTP layer, model.layers.LAYERS.*: a decoder layer (a fifth layer of a model built
    one layer deeper, so its shapes and names are transformers' own), its own norms and projection (off init), and
    its copies of the embedding and the head. config.json declares num_nextn_predict_layers = 1."""
    torch.manual_seed(seed)
    deeper = randomise(make(LAYERS + 1, 0)).eval()
    model = make(LAYERS, 1).eval()
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


def _same_release(released: Path, out: Path) -> dict:
    """out (a to-hf output) holds every tensor of released bit for bit, the MTP layer's included, declares the MTP
    layer, and transformers computes the same logits from both; returns released's tensors."""
    want, got = saved_tensors(released), saved_tensors(out)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert torch.equal(hf_logits(out), hf_logits(released))
    return want


def test_released_mtp_layer_is_read_and_written_back_bit_exact(released, tmp_path):
    """from the released form: inspect names the MTP layer; to-hf through Megatron (EP 2) writes every tensor back
    bit-exact, the MTP layer's included, and transformers' MtpModel loads it."""
    from ckptool import quick_inspect
    ckpt = open_checkpoint(released)
    assert ckpt.config.mtp_num_layers == 1 and ckpt.config.num_layers == LAYERS
    assert f"layers.{LAYERS}.mtp.eh_proj.weight" in ckpt.tensors and ckpt.config.is_moe_layer(LAYERS)
    assert "mtp         1 multi-token-prediction layer(s): layer(s) 3..3" in cli("inspect", released)
    assert json.loads(cli("inspect", released, "--json"))["config"]["mtp_num_layers"] == 1
    quick = quick_inspect.quick_open(released, {})  # inspect's torch-free reader sees it too
    assert quick is not None and quick.config.mtp_num_layers == 1 and set(quick.tensors) == set(ckpt.tensors)
    cli("from-hf", released, tmp_path / "meg", "--ep", 2)
    cli("to-hf", tmp_path / "meg", tmp_path / "hf")
    want = _same_release(released, tmp_path / "hf")
    _, mtp = mtp_model(tmp_path / "hf")
    layer = mtp.layers[0]
    assert torch.equal(layer.eh_proj.weight, want[f"model.layers.{LAYERS}.eh_proj.weight"])
    assert torch.equal(layer.post_norm.weight, want[f"model.layers.{LAYERS}.shared_head.norm.weight"])
    assert torch.equal(layer.mtp_block.self_attn.kv_b_proj.weight,
                       want[f"model.layers.{LAYERS}.self_attn.kv_b_proj.weight"])


def test_glm_mtp_layer_is_read_and_written_back_bit_exact(tmp_path):
    """GLM-4.5 as released with its MTP layer (DeepSeek-V3's names): through Megatron (EP 2, torch_dist) and back,
    every tensor bit-exact, the MTP layer's included, and transformers' logits equal."""
    released = as_released(tmp_path / "glm_mtp", seed=43, make=_glm)
    ckpt = open_checkpoint(released)
    assert ckpt.config.mtp_num_layers == 1 and f"layers.{LAYERS}.mtp.eh_proj.weight" in ckpt.tensors
    cli("from-hf", released, tmp_path / "meg", "--ep", 2)
    cli("reshard", tmp_path / "meg", tmp_path / "dist", "--format", "torch_dist")
    cli("to-hf", tmp_path / "dist", tmp_path / "hf")
    _same_release(released, tmp_path / "hf")


MTP_HELPER = Path(__file__).with_name("mcore_mtp_helper.py")


@pytest.fixture(scope="module")
def mcore_runs(released, tmp_path_factory):
    """ckptool's Megatron outputs of the released model (torch at EP 2, at TP 2 and at PP 2, torch_dist) and
    megatron-core's runs on them (tests/mcore_mtp_helper.py, one torchrun launch of 2 processes; the torch_dist
    output loaded at PP 1 and PP 2): {name: (dir, what it saved)}."""
    from conftest import run_torchrun
    d = tmp_path_factory.mktemp("mtp_mcore")
    cli("from-hf", released, d / "ep2", "--ep", 2)
    cli("from-hf", released, d / "tp2", "--tp", 2)
    cli("from-hf", released, d / "pp2", "--pp", 2, "--pp-layers", "2,1")  # the MTP layer and its embedding copy last
    cli("reshard", d / "ep2", d / "dist", "--ep", 1, "--format", "torch_dist")
    jobs = {"ep2": ("ep2", "--ep 2"), "tp2": ("tp2", "--tp 2"), "pp2": ("pp2", "--pp 2"), "dist": ("dist", "--dist"),
            "dist_pp2": ("dist", "--dist --pp 2")}
    res = run_torchrun(2, MTP_HELPER, *[f"{d / src} {more} --out {d / n}.pt" for n, (src, more) in jobs.items()],
                       timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {n: (d / src, torch.load(f"{d / n}.pt")) for n, (src, _) in jobs.items()}


# the rank file whose parameters the helper lists (the last stage's, which holds the MTP block)
RANK_FILE = {"ep2": "mp_rank_00_000", "tp2": "mp_rank_00", "pp2": "mp_rank_00_001"}


@pytest.mark.parametrize("name", ["ep2", "tp2", "pp2", "dist", "dist_pp2"])
def test_megatron_core_loads_our_mtp_block_strictly(released, mcore_runs, name):
    """megatron-core's GPTModel with --mtp-num-layers 1 (its MTP block over the last decoder layer's spec: MLA and
    MoE) loads our Megatron torch output (EP 2, TP 2, PP 2) and torch_dist (at PP 1 and PP 2) with
    load_state_dict(strict=True); the rank file lists the MTP block's parameters in megatron-core's order (after the
    decoder's final norm, before the output layer: its optimizer's order; at PP 2 the last stage's copy of the word
    embedding first); its main logits equal transformers' (MTP does not change them), and at PP 2 the last stage's
    embedding copy megatron-core loaded is the model's embedding."""
    from mcore_dist_helper import TOKENS
    path, saved = mcore_runs[name]
    assert saved["mtp_layers"] == 1
    assert any(p.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for p in saved["params"])
    if name.endswith("pp2"):
        embed = saved_tensors(released)["model.embed_tokens.weight"]
        assert saved["params"][0] == "embedding.word_embeddings.weight"
        assert torch.equal(saved["embedding_copy"][:embed.shape[0]], embed)
    if name in RANK_FILE:
        ours = torch.load(path / "iter_0000000" / RANK_FILE[name] / "model_optim_rng.pt", weights_only=False)
        buffers = ("_extra_state", "router.expert_bias")  # module state that is no parameter
        assert [k for k in ours["model"] if not k.endswith(buffers)] == saved["params"]
        assert ours["args"].mtp_num_layers == 1
    want = hf_logits(released, TOKENS)
    got = saved["logits"][..., :want.shape[-1]]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    from ckptool import quick_inspect
    quick = quick_inspect.quick_open(path, {})  # inspect's torch-free readers see the MTP block
    assert quick is not None and quick.config.mtp_num_layers == 1
    back = open_checkpoint(path)  # and ckptool reads the MTP layer back
    assert set(quick.tensors) == set(back.tensors)
    assert back.config.mtp_num_layers == 1 and torch.equal(
        back.tensors[f"layers.{LAYERS}.mtp.eh_proj.weight"].load(),
        saved_tensors(released)[f"model.layers.{LAYERS}.eh_proj.weight"])


def test_verify_runs_the_main_model_beside_the_mtp_layer(released, mcore_runs):
    """verify computes the main model's logits (MTP does not change them) and does not trip on the MTP tensors:
    one process, and under torchrun at the EP 2 layout (each rank its own experts, the MTP layer's too)."""
    from conftest import run_torchrun
    path = mcore_runs["ep2"][0]
    assert "result=PASS" in cli("verify", path, "--reference", released)
    assert "result=PASS" in cli("verify", mcore_runs["pp2"][0], "--reference", released)  # the embedding copy beside
    res = run_torchrun(2, "-m", "ckptool", "verify", str(path), "--reference", str(released), timeout=600)
    assert res.returncode == 0 and "result=PASS" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def test_drop_mtp_writes_the_main_model_and_says_so(released, tmp_path):
    """--drop-mtp: to-hf writes the main model only (num_nextn_predict_layers 0), every main tensor bit-exact,
    the same logits, and says what it dropped."""
    out = cli("to-hf", released, tmp_path / "hf", "--drop-mtp")
    assert "--drop-mtp: dropped the 1 multi-token-prediction (MTP) layer(s) (layers 3..3" in out
    want = {k: v for k, v in saved_tensors(released).items() if not k.startswith(f"model.layers.{LAYERS}.")}
    got = saved_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(released))


@pytest.fixture(scope="module")
def llama_mtp(tmp_path_factory):
    """A Llama with an MTP layer in megatron-core's torch format (the layout test_megatron_core_loads_our_mtp_block_
    strictly checks): a class Hugging Face has no MTP form for. Built in the canonical state: the tiny Llama's
    tensors, its last layer's again as the MTP layer's decoder layer, and MTP norms and projection off init."""
    d = tmp_path_factory.mktemp("llama_mtp")
    torch.manual_seed(5)
    model = randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, intermediate_size=64,
                                                                             num_hidden_layers=2))).eval()
    return _with_mtp_layer(model, d), model


def _with_mtp_layer(model, d: Path) -> Path:
    """model (a Hugging Face class without an MTP form) saved, then written in megatron-core's torch format (d/meg)
    with an MTP layer: its last layer's tensors again as the MTP layer's decoder layer, MTP norms (with biases for
    LayerNorm) and projection off init."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.lazy import Const
    from ckptool.state import in_model_order
    from ckptool.write_options import WriteOptions
    model.save_pretrained(d / "hf")
    ckpt = open_checkpoint(d / "hf")
    last, h = ckpt.config.num_layers - 1, ckpt.config.hidden_size
    tensors = dict(ckpt.tensors)
    tensors.update({n.replace(f"layers.{last}.", f"layers.{last + 1}.", 1): t for n, t in ckpt.tensors.items()
                    if n.startswith(f"layers.{last}.")})
    own = [("enorm.weight", torch.rand(h) + 0.5), ("hnorm.weight", torch.rand(h) + 0.5),
           ("final_norm.weight", torch.rand(h) + 0.5), ("eh_proj.weight", torch.randn(h, 2 * h) * 0.15)]
    if ckpt.config.normalization == "layernorm":
        own += [(n.replace("weight", "bias"), torch.randn(h) * 0.1) for n, _ in own if "norm" in n]
    tensors.update({f"layers.{last + 1}.mtp.{n}": Const(w) for n, w in own})
    cfg = ckpt.config.replace(mtp_num_layers=1)
    write_layout(ckpt.with_tensors(in_model_order(tensors, cfg), mtp_num_layers=1), d / "meg", Layout(1, 1),
                 WriteOptions(format="torch", dialect="mcore"), warn=lambda m: None)
    return d / "meg"


@pytest.mark.parametrize("command, says", [
    (("to-hf",), ("multi-token-prediction (MTP) layers and LlamaForCausalLM has no place for them", "--drop-mtp")),
    (("reshard", "--format", "ds-universal"), ("multi-token prediction (MTP): 1 MTP layer(s)", "ds-universal",
                                               "--drop-mtp")),
    (("reshard", "--dialect", "legacy-norm"), ("the legacy-norm dialect predates megatron-core's MTP block",)),
])
def test_targets_that_cannot_hold_mtp_refuse_it_by_name(llama_mtp, tmp_path, command, says):
    """A target without a place for MTP layers refuses them in one line naming them (never drops them silently),
    and writes nothing."""
    _one_line_refusal(command[0], llama_mtp[0], tmp_path / "out", *command[1:], says=says)
    assert not (tmp_path / "out").exists()


def test_drop_mtp_exports_a_llama_without_its_mtp_layer(llama_mtp, tmp_path):
    meg, model = llama_mtp
    out = cli("to-hf", meg, tmp_path / "hf", "--drop-mtp")
    assert "dropped the 1 multi-token-prediction (MTP) layer(s) (layers 2..2, 4 tensors" not in out  # 13 with its layer
    assert "--drop-mtp: dropped the 1 multi-token-prediction (MTP) layer(s) (layers 2..2" in out
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(model))


def test_an_mtp_copy_that_differs_from_the_main_model_is_refused(released, tmp_path):
    """The MTP layer's own embed_tokens / shared_head.head are checked equal to the main model's (the canonical state
    keeps one of each); one that differs is refused by name, nothing written."""
    from safetensors.torch import load_file
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in released.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    mtp = load_file(str(bad / "model-mtp.safetensors"))
    mtp[f"model.layers.{LAYERS}.shared_head.head.weight"][0, 0] += 1.0
    save_file(mtp, str(bad / "model-mtp.safetensors"))
    _one_line_refusal("from-hf", bad, tmp_path / "out", says=[f"model.layers.{LAYERS}.shared_head.head.weight differs "
                                                              "from the main model's output.weight"])
    assert not (tmp_path / "out").exists()


def test_optimizer_slots_of_the_mtp_layer_flow_like_any_parameters(mcore_runs, tmp_path):
    """The optimizer paths key slots by canonical tensor: Adam moments of the MTP layer's parameters (its own and
    its decoder layer's experts) are written into Megatron's rank files in megatron-core's parameter order (EP 2) and
    read back bit-exact, also resharded to TP 2. (No megatron-core MTP training to compare with here.)"""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.lazy import Const
    from ckptool.roles import is_parameter
    from ckptool.state import OptimizerState, ParamGroup
    from ckptool.write_options import WriteOptions
    ckpt = open_checkpoint(mcore_runs["ep2"][0])
    torch.manual_seed(7)
    params = [n for n in ckpt.tensors if is_parameter(n)]
    slots = {s: {n: Const(torch.randn(ckpt.tensors[n].shape)) for n in params} for s in ("exp_avg", "exp_avg_sq")}
    ckpt.optimizer = OptimizerState("megatron", slots, step=3, param_groups=[ParamGroup(params, {"lr": 1e-4,
                                                                                                 "weight_decay": 0.1})])
    mtp = [n for n in params if n.startswith(f"layers.{LAYERS}.")]
    assert any(".mtp." in n for n in mtp) and any(".experts." in n for n in mtp)
    for out, layout in (("ep2", Layout(1, 1, ep=2)), ("tp2", Layout(2, 1))):
        write_layout(ckpt, tmp_path / out, layout, WriteOptions(format="torch"), warn=lambda m: None)
        back = open_checkpoint(tmp_path / out).optimizer
        for s in slots:
            for n in (params if out == "ep2" else mtp):  # at TP 2 the vocabulary is padded again
                assert torch.equal(back.slots[s][n].load(), slots[s][n].load()), (out, s, n)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=32, n_head=4,
                                                                n_layer=2, n_positions=64))


def _tied_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(COMMON, tie_word_embeddings=True),
                                                                  intermediate_size=64, num_hidden_layers=2))


@pytest.mark.parametrize("make, says", [(_gpt2, "with learned absolute position embeddings"),
                                        (_tied_llama, "with tied embeddings")])
def test_mtp_at_pp2_that_megatron_core_keeps_apart_is_refused_by_name(tmp_path, make, says):
    """At PP > 1 megatron-core 0.16.1 keeps on the MTP stage a second position table it never synchronises with
    the first stage's, and with tied embeddings an output layer weight its forward never uses: models with learned
    positions or tied embeddings and MTP layers are refused at PP > 1 (written at PP 1)."""
    torch.manual_seed(6)
    meg = _with_mtp_layer(randomise(make()).eval(), tmp_path)
    assert open_checkpoint(meg).config.mtp_num_layers == 1
    _one_line_refusal("reshard", meg, tmp_path / "out", "--pp", "2", says=[
        f"multi-token prediction (MTP) layers at --pp 2 {says}", "--drop-mtp"])
    assert not (tmp_path / "out").exists()


def test_an_mtp_embedding_copy_that_differs_on_the_last_stage_is_refused(mcore_runs, tmp_path):
    """At PP 2 the last stage's file holds megatron-core's copy of the word embedding for the MTP block: ckptool
    reads it back only if it equals the first stage's (one is kept), and refuses it by name otherwise."""
    import shutil
    src = tmp_path / "pp2"
    shutil.copytree(mcore_runs["pp2"][0], src)
    f = src / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["model"]["embedding.word_embeddings.weight"][3, 0] += 1.0
    torch.save(sd, f)
    _one_line_refusal("reshard", src, tmp_path / "out", "--pp", "1", says=[
        "embedding.word_embeddings.weight on pipeline stage 1 (TP rank 0) differs from the first stage's"])
    assert not (tmp_path / "out").exists()


# --- Qwen3-Next / Qwen3.5: MTP layers ckptool has no family for (issue 30) -----------------------------------------
# Their releases name the MTP block mtp.fc ([h, 2h]), mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden, mtp.norm and
# mtp.layers.{k}.* (a full-attention decoder layer); transformers leaves them out on load (_keys_to_ignore_on_load_
# unexpected ^mtp.*). Their decoders interleave Gated DeltaNet linear-attention layers with gated full attention.
LINEAR_ATTENTION = dict(vocab_size=COMMON["vocab_size"], hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
                        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                        layer_types=["linear_attention", "full_attention"])


def _qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **LINEAR_ATTENTION, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2))


def _qwen3_5():
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**LINEAR_ATTENTION))


@pytest.mark.parametrize("make, name", [(_qwen3_next, "Qwen3-Next (model_type qwen3_next"),
                                        (_qwen3_5, "Qwen3.5 (model_type qwen3_5_text")])
def test_qwen3_next_and_qwen3_5_with_mtp_are_refused_by_name(tmp_path, make, name):
    """A tiny Qwen3-Next / Qwen3.5 saved by transformers with the release's MTP tensors beside it (index file as
    released): inspect and from-hf refuse it in one line naming the family, its linear attention and its MTP layers;
    nothing is written."""
    torch.manual_seed(8)
    src = tmp_path / "src"
    make().save_pretrained(src)
    h = LINEAR_ATTENTION["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": torch.rand(h),
           "mtp.pre_fc_norm_hidden.weight": torch.rand(h), "mtp.norm.weight": torch.rand(h),
           "mtp.layers.0.input_layernorm.weight": torch.rand(h), "mtp.layers.0.self_attn.o_proj.weight": torch.randn(h, h)}
    save_file(mtp, str(src / "model-mtp.safetensors"))
    weight_map = {**{k: "model.safetensors" for k in saved_tensors_of(src / "model.safetensors")},
                  **{k: "model-mtp.safetensors" for k in mtp}}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    says = [name, "Gated DeltaNet linear-attention", "multi-token-prediction layers mtp.*", "not supported"]
    _one_line_refusal("inspect", src, says=says)
    _one_line_refusal("from-hf", src, tmp_path / "out", says=says)
    assert not (tmp_path / "out").exists()
