"""`ckptool inspect PATH [--json]`: what a checkpoint is, without converting anything."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Optional

import click

if TYPE_CHECKING:  # the full path imports torch; the quick one (quick_inspect.py) must not
    from ..state import Checkpoint
from ..quick_inspect import quick_open
from .common import human_bytes, reports_errors, source_options, print_warnings

INSPECT_SCHEMA_VERSION = 1


def _moe(moe) -> Optional[dict]:
    if moe is None:
        return None
    doc = dataclasses.asdict(moe)
    doc["layers"] = list(moe.layers)
    return doc


def describe(ckpt: Checkpoint) -> dict:
    """The stable `inspect --json` document (schema in docs/inspect-json.md)."""
    cfg, src = ckpt.config, ckpt.source
    return {
        "schema_version": INSPECT_SCHEMA_VERSION,
        "path": src.path,
        "format": src.format,
        "dialect": src.dialect,
        "storage": src.storage,
        "iteration": src.iteration,
        "release": src.release,
        "checkpoint_version": src.checkpoint_version,
        "layout": {"tp": src.layout.tp, "pp": src.layout.pp, "vpp": src.layout.vpp,
                   "dp": src.layout.dp, "ep": src.layout.ep, "stage_layers": list(src.layout.stage_layers) if src.layout.stage_layers else None},
        "config": {
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.num_query_groups,
            "head_dim": cfg.head_dim, "ffn_hidden_size": cfg.ffn_hidden_size,
            "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.padded_vocab_size,
            "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
            "max_position_embeddings": cfg.max_position_embeddings,
            "normalization": cfg.normalization, "norm_eps": cfg.norm_eps,
            "activation": cfg.activation, "position_embedding": cfg.position_embedding,
            "rotary_base": cfg.rotary_base, "rotary_percent": cfg.rotary_percent,
            "rotary_interleaved": cfg.rotary_interleaved,
            "tied_embeddings": cfg.tied_embeddings, "add_bias_linear": cfg.add_bias_linear,
            "add_qkv_bias": cfg.add_qkv_bias, "qk_layernorm": cfg.qk_layernorm,
            "apply_layernorm_1p": cfg.apply_layernorm_1p,
            "moe": _moe(cfg.moe),
            "mla": dataclasses.asdict(cfg.mla) if cfg.mla is not None else None,
            "rope_yarn": dataclasses.asdict(cfg.rope_yarn) if cfg.rope_yarn is not None else None,
        },
        "vocab_size_source": cfg.vocab_size_source,
        "total_bytes": ckpt.total_bytes,
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                    for n, t in ckpt.tensors.items()],
        "optimizer": describe_optimizer(ckpt),
        "warnings": list(ckpt.warnings),
    }


def describe_optimizer(ckpt: Checkpoint):
    """The training state beside the weights, or None for a weights-only checkpoint."""
    opt = ckpt.optimizer
    if opt is None:
        return None
    dtypes = {slot: sorted({str(t.dtype).replace("torch.", "") for t in ts.values()}) for slot, ts in opt.slots.items()}
    return {"kind": opt.kind, "step": opt.step, "slots": opt.slot_names(), "dtypes": dtypes,
            "bytes": opt.total_bytes, "consumed_samples": opt.consumed_samples,
            "scheduler": opt.scheduler is not None, "grad_scaler": opt.grad_scaler is not None,
            "param_groups": [{"tensors": len(g.names),
                              **{k: g.hyper[k] for k in ("lr", "weight_decay", "wd_mult", "lr_mult", "max_lr", "min_lr")
                                 if k in g.hyper and isinstance(g.hyper[k], (int, float))}}
                             for g in opt.param_groups]}


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
        from .. import api
        ckpt = api.open(path, **kw)
    doc = describe(ckpt)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
        return
    c = doc["config"]
    lay = ckpt.source.layout
    click.echo(f"path        {doc['path']}")
    click.echo(f"format      {doc['format']}  dialect {doc['dialect'] or '-'}"
               + (f"  storage {doc['storage']}" if doc["storage"] else "")
               + (f"  checkpoint_version {doc['checkpoint_version']}" if doc["checkpoint_version"] is not None else ""))
    click.echo(f"iteration   {'release' if doc['release'] else doc['iteration']}")
    click.echo(f"layout      {lay.describe()}" + (f" DP{lay.dp}" if lay.dp > 1 else ""))
    click.echo(f"model       {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
               f"({c['num_query_groups']} query groups, head dim {c['head_dim']}), ffn {c['ffn_hidden_size']}")
    click.echo(f"            {c['normalization']} eps {c['norm_eps']}, {c['activation']}, "
               f"{c['position_embedding']} positions (max {c['max_position_embeddings']}), "
               f"{'tied' if c['tied_embeddings'] else 'untied'} embeddings, "
               f"{'biases' if c['add_bias_linear'] else 'no biases'}")
    if c["moe"]:
        m = c["moe"]
        shared = f", shared expert ffn {m['shared_ffn_hidden_size']}" + (" (gated)" if m["shared_gate"] else "")
        extra = "".join(text for text, on in (
            (f" from the best {m['group_topk']} of {m['num_groups']} groups", m["num_groups"] > 1),
            (f" x {m['scaling_factor']}", m["scaling_factor"] != 1.0), (" with expert bias", m["expert_bias"])) if on)
        click.echo(f"experts     {m['num_experts']} per MoE layer, top-{m['top_k']} {m['score_function']}"
                   f"{' renormalised' if m['topk_norm'] else ''}{extra}, expert ffn {m['ffn_hidden_size']}"
                   f"{shared if m['shared_ffn_hidden_size'] else ''}; MoE layers {m['layers']}")
    if c["mla"]:
        m = c["mla"]
        click.echo(f"attention   Multi-Latent: q latent {m['q_lora_rank'] or '- (direct q)'}, kv latent "
                   f"{m['kv_lora_rank']}, head qk {m['qk_nope_head_dim']}+{m['qk_rope_head_dim']} (nope+rope), "
                   f"v {m['v_head_dim']}" + (f"; YaRN factor {c['rope_yarn']['factor']}" if c["rope_yarn"] else ""))
    click.echo(f"vocab       true {c['vocab_size'] if c['vocab_size'] is not None else 'unknown'} "
               f"(from {doc['vocab_size_source']}), stored rows {c['padded_vocab_size']}")
    click.echo(f"size        {len(doc['tensors'])} tensors, {human_bytes(doc['total_bytes'])}")
    o = doc["optimizer"]
    if o is None:
        click.echo("optimizer   none (weights only)")
    else:
        max_lrs = {g.get("max_lr") for g in o["param_groups"]}  # shown where groups differ (--decoupled-lr)
        groups = ", ".join(f"{g['tensors']} tensors wd {g.get('weight_decay', '?')}"
                           + (f" wd_mult {g['wd_mult']}" if g.get("wd_mult", 1) != 1 else "")  # megatron-core's
                           + (f" lr_mult {g['lr_mult']}" if g.get("lr_mult", 1) != 1 else "")  # per-group factors
                           + (f" max_lr {g['max_lr']}" if len(max_lrs) > 1 else "") for g in o["param_groups"])
        click.echo(f"optimizer   {o['kind']}, step {o['step']}, {' + '.join(o['slots'])} "
                   f"({'/'.join(sorted({d for ds in o['dtypes'].values() for d in ds}))}), "
                   f"{human_bytes(o['bytes'])}; groups: {groups or 'none'}")
    if tensors:
        width = max(len(t["name"]) for t in doc["tensors"])
        for t in doc["tensors"]:
            click.echo(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']}")
    print_warnings(ckpt)
    policy = ckpt.source.extra.get("replica_policy")  # replicas compared so far (as tensors load)
    if policy is not None and policy.report():
        click.echo(policy.report())
