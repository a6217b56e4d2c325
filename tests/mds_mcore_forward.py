"""megatron-core's own TP2 PP2 forward of a Megatron-DeepSpeed pipeline checkpoint, each rank on its own copies.

Usage: torchrun --nproc-per-node 4 tests/mds_mcore_forward.py "TOKENS.pt GLOBAL_STEP_DIR OUT.pt" ...

(one job per argument, tests/torchrun_jobs.py; tests/conftest.py runs its jobs in the shared megatron-core launch of
4 processes, tests/mcore_jobs.py)

Megatron-DeepSpeed's GPT-2 (legacy ParallelTransformerLayer) and megatron-core's GPTModel with the local spec
compute the same maths with the same tensor-parallel split: vocab-parallel embedding plus the rank's own
position rows, layer norms on the rank's own copies, fused QKV column-parallel (per head [q, k, v] rows),
row-parallel projections all-reduced and then their bias added on each rank from its own copy, the final
norm and the vocab-parallel logits on the last stage. So a drifted checkpoint (replicas that differ per TP
rank) loaded into megatron-core rank by rank, as DeepSpeed's pipeline engine loads it (rank (tp t, stage p)
from layer_LL-model_TT files of its stage; the last stage's tied output matrix is the first stage's word
embeddings, which the engine broadcasts to it on load), gives the logits the framework computes with each
rank's own copies. Rank order is megatron-core's and DeepSpeed's alike: rank = stage x TP + TP rank.
Checked against the real framework: on the unmodified real checkpoint these logits equal
Megatron-DeepSpeed's recorded logits_fp32 (tests/test_verify_deepspeed.py).

Each OUT.pt holds `tokens` (TOKENS.pt's) and `logits` [B, S, padded vocab] (fp32 compute from the 16-bit weights).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_dist_helper as H  # noqa: E402  (megatron-core imported eagerly, its CPU shims in place)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from torchrun_jobs import run_jobs  # noqa: E402

TP, PP = 2, 2
# the real case's architecture (fixtures/real/mds_gpt2_pipe_tp2pp2_bf16_zero1/CASE.md)
LAYERS, HIDDEN, HEADS, FFN, PADDED, MAX_POS = 4, 64, 4, 256, 1024, 64
EMBED_FILE, FIRST_LAYER_FILE, FINAL_NORM_FILE = 1, 2, 6  # spec indices of the layer files
# megatron-core (local spec) name inside a decoder layer -> the key in the Megatron-DeepSpeed layer file
LAYER_KEYS = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
              "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
              "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def stage_model():
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32, pipeline_model_parallel_size=PP,
                            tensor_model_parallel_size=TP, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED,
                    max_sequence_length=MAX_POS, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=True, pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage()).eval()


def own_tensors(step: Path, t: int, p: int) -> dict:
    """megatron-core name -> this rank's tensor from its own layer files (what DeepSpeed loads on it)."""
    def layer_file(idx):
        return torch.load(step / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
    out = {}
    embed = layer_file(EMBED_FILE)
    if p == 0:
        out["embedding.word_embeddings.weight"] = embed["word_embeddings.weight"]
        out["embedding.position_embeddings.weight"] = embed["position_embeddings.weight"]
    per_stage = LAYERS // PP
    for j in range(per_stage):
        src = layer_file(FIRST_LAYER_FILE + p * per_stage + j)
        for mine, theirs in LAYER_KEYS.items():
            for kind in ("weight", "bias"):
                out[f"decoder.layers.{j}.{mine}.{kind}"] = src[f"{theirs}.{kind}"]
    if p == PP - 1:
        final = layer_file(FINAL_NORM_FILE)
        out.update({"decoder.final_layernorm.weight": final["weight"], "decoder.final_layernorm.bias": final["bias"]})
        out["output_layer.weight"] = embed["word_embeddings.weight"]  # broadcast from the first stage on load
    return out


def run(step: Path, tokens: torch.Tensor, out_file: str) -> None:
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    model = stage_model()
    values = own_tensors(step, t, p)
    with torch.no_grad():
        params = dict(model.named_parameters())
        assert set(params) == set(values), sorted(set(params) ^ set(values))
        for name, param in params.items():
            param.copy_(values[name].float())
        logits = H.logits(model, tokens)
    if logits is not None and t == 0:
        torch.save({"tokens": tokens, "logits": logits.float()}, out_file)
    dist.barrier()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="megatron-core's TP2 PP2 forward of a Megatron-DeepSpeed pipeline step")
    ap.add_argument("tokens", help="TOKENS.pt: its `tokens` are the rows computed")
    ap.add_argument("step", help="the checkpoint's global_step folder")
    ap.add_argument("out", help="OUT.pt: tokens and logits")
    return ap


def run_job(a) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    try:
        run(Path(a.step), torch.load(a.tokens)["tokens"], a.out)
    finally:
        parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    run_jobs(parser(), run_job)
