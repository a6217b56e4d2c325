"""`ckptool inspect PATH [--json]`: what a checkpoint is, without converting anything."""
from __future__ import annotations

import json

import click

from ..describe import describe
from ..quick_inspect import quick_open
from .common import human_bytes, reports_errors, source_options, print_warnings
from .. import api


@click.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document (schema: docs/inspect-json.md).")
@click.option("--tensors/--no-tensors", default=True, help="List every canonical tensor (text output).")
@source_options
@reports_errors
def inspect_cmd(path, as_json, tensors, **kw):
    """Show a checkpoint's format, dialect, layout, config, vocab and tensors.

    PATH is any checkpoint ckptool reads: a Megatron save directory (or one iter_* directory), a
    torch_dist / DCP directory, a DeepSpeed checkpoint, or a Hugging Face model directory.
    Nothing is converted and nothing is written.
    """
    ckpt = quick_open(path, kw)  # metadata-only formats without importing torch (quick_inspect.py)
    if ckpt is None:
        ckpt = api.open(path, **kw)
    doc = describe(ckpt)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo("\n".join(_summary_lines(doc, ckpt.source.layout)))
    if tensors:
        width = max(len(t["name"]) for t in doc["tensors"])
        for t in doc["tensors"]:
            click.echo(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']}")
    print_warnings(ckpt)
    policy = ckpt.source.extra.get("replica_policy")  # replicas compared so far (as tensors load)
    if policy is not None and policy.report():
        click.echo(policy.report())


def _summary_lines(doc: dict, lay) -> list:
    """inspect's text form, before the tensor list: what the checkpoint is, one fact per line."""
    c = doc["config"]
    lines = [
        f"path        {doc['path']}",
        f"format      {doc['format']}  dialect {doc['dialect'] or '-'}"
        + (f"  storage {doc['storage']}" if doc["storage"] else "")
        + (f"  checkpoint_version {doc['checkpoint_version']}" if doc["checkpoint_version"] is not None else ""),
        f"iteration   {'release' if doc['release'] else doc['iteration']}",
        f"layout      {lay.describe()}" + (f" DP{lay.dp}" if lay.dp > 1 else ""),
        f"model       {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
        f"({c['num_query_groups']} query groups, head dim {c['head_dim']}), ffn {c['ffn_hidden_size']}",
        f"            {c['normalization']} eps {c['norm_eps']}, {c['activation']}, "
        f"{c['position_embedding']} positions (max {c['max_position_embeddings']}){_partial_rope(c)}, "
        f"{'tied' if c['tied_embeddings'] else 'untied'} embeddings, {_biases(c)}"
        + (", q/k norms" if c["qk_layernorm"] else ""),
    ]
    lines += [_experts_line(c["moe"])] if c["moe"] else []
    lines += [_mla_line(c["mla"], c["rope_yarn"])] if c["mla"] else []
    lines += [line for line in (_maths_line(c), _gemma_line(c["gemma"]) if c["gemma"] else "") if line]
    lines += [_mtp_line(c)] if c.get("mtp_num_layers") else []
    lines += [f"vocab       true {c['vocab_size'] if c['vocab_size'] is not None else 'unknown'} "
              f"(from {doc['vocab_size_source']}), stored rows {c['padded_vocab_size']}",
              f"size        {len(doc['tensors'])} tensors, {human_bytes(doc['total_bytes'])}",
              _optimizer_line(doc["optimizer"])]
    return lines


def _partial_rope(c: dict) -> str:
    """RoPE on part of each head (--rotary-percent; GLM-4.5's partial_rotary_factor), said where it is."""
    return f" on {c['rotary_percent']:g} of each head" if c["position_embedding"] == "rope" and \
        c["rotary_percent"] != 1.0 else ""


def _biases(c: dict) -> str:
    return "biases" if c["add_bias_linear"] else ("q/k/v biases only" if c["add_qkv_bias"] else "no biases")


def _maths_line(c: dict) -> str:
    """The maths beside plain GPT a model has (GPT-OSS, Gemma 2/3, a windowed megatron-core run: describe.MATHS_FIELDS,
    the (1 + w) norm, YaRN), "" when it has none."""
    offset = c["glu_linear_offset"]
    clamp = f"GLU clamp {c['glu_clamp']}" + (f", linear half + {offset}" if offset else "")
    parts = [text for text, on in (
        ("(1 + w) norms", c["apply_layernorm_1p"]), ("attention sinks", c["attn_sinks"]),
        (f"window {c['sliding_window']} on layers {','.join(map(str, c['local_layers']))} of {c['num_layers']}",
         c["sliding_window"]),
        (f"score soft-cap {c['attn_softcap']}", c["attn_softcap"]),
        (f"logit soft-cap {c['final_softcap']}", c["final_softcap"]),
        (clamp, c["glu_clamp"] is not None),
        # YaRN: the MLA line says it for MLA models
        (f"YaRN factor {(c['rope_yarn'] or {}).get('factor')}", c["rope_yarn"] and not c["mla"])) if on]
    return "maths       " + ", ".join(parts) if parts else ""


def _gemma_line(g: dict) -> str:
    """Gemma's own maths, the ones the model has ("" for none: its window and soft-caps are on the maths line)."""
    parts = [text for text, on in (
        ("embedding x sqrt(hidden)", g["embedding_scale"]), ("post-attention/MLP norms", g["post_norms"]),
        (f"scores x {g['query_pre_attn_scalar']}^-1/2", g["query_pre_attn_scalar"]),
        (f"local rope base {g['rotary_base_local']}", g["rotary_base_local"]),
        (f"global rope / {g['rope_linear_factor']}", g["rope_linear_factor"])) if on]
    return "gemma       " + ", ".join(parts) if parts else ""


def _experts_line(m: dict) -> str:
    shared = f", shared expert ffn {m['shared_ffn_hidden_size']}" + (" (gated)" if m["shared_gate"] else "")
    extra = "".join(text for text, on in (
        (f" from the best {m['group_topk']} of {m['num_groups']} groups", m["num_groups"] > 1),
        (f" x {m['scaling_factor']}", m["scaling_factor"] != 1.0), (" with expert bias", m["expert_bias"])) if on)
    return (f"experts     {m['num_experts']} per MoE layer, top-{m['top_k']} {m['score_function']}"
            f"{' renormalised' if m['topk_norm'] else ''}{extra}, expert ffn {m['ffn_hidden_size']}"
            f"{shared if m['shared_ffn_hidden_size'] else ''}; MoE layers {m['layers']}")


def _mtp_line(c: dict) -> str:
    n, first = c["mtp_num_layers"], c["num_layers"]
    return (f"mtp         {n} multi-token-prediction layer(s): layer(s) {first}..{first + n - 1} after the decoder, each "
            "with enorm, hnorm, eh_proj and its final norm; the embedding and output head shared with the main model")


def _mla_line(m: dict, yarn) -> str:
    return (f"attention   Multi-Latent: q latent {m['q_lora_rank'] or '- (direct q)'}, kv latent "
            f"{m['kv_lora_rank']}, head qk {m['qk_nope_head_dim']}+{m['qk_rope_head_dim']} (nope+rope), "
            f"v {m['v_head_dim']}" + (f"; YaRN factor {yarn['factor']}" if yarn else ""))


def _optimizer_line(o) -> str:
    if o is None:
        return "optimizer   none (weights only)"
    max_lrs = {g.get("max_lr") for g in o["param_groups"]}  # shown where groups differ (--decoupled-lr)
    groups = ", ".join(f"{g['tensors']} tensors wd {g.get('weight_decay', '?')}"
                       + (f" wd_mult {g['wd_mult']}" if g.get("wd_mult", 1) != 1 else "")  # megatron-core's
                       + (f" lr_mult {g['lr_mult']}" if g.get("lr_mult", 1) != 1 else "")  # per-group factors
                       + (f" max_lr {g['max_lr']}" if len(max_lrs) > 1 else "") for g in o["param_groups"])
    return (f"optimizer   {o['kind']}, step {o['step']}, {' + '.join(o['slots'])} "
            f"({'/'.join(sorted({d for ds in o['dtypes'].values() for d in ds}))}), "
            f"{human_bytes(o['bytes'])}; groups: {groups or 'none'}")
