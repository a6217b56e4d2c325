"""torch_dist MoE optimizer state (megatron-core's ChainedOptimizer [dense, expert]), real megatron-core.

At EP > 1 megatron-core keeps the experts in a second, expert-parallel optimizer. In torch_dist the
chain's common state is {0: dense entry, 1: expert entry} (param groups, step, sharding type), while the
tensors of both sit under the one prefix `optimizer.state.<slot>.<model key>` (fully_reshardable and the
non-distributed optimizer add no chained_N. prefix), the experts' under the stacked expert keys the
weights use. ckptool reads the experts' masters and moments under their canonical names
(tests/mcore_optim_dist_helper.py moe-save: one Adam step of mcore_moe_helper's Mixtral-like model, bf16
with fp32 masters), each equal to the live optimizer's, at TP1 EP2 (both optimizer kinds) and TP2 EP2; and
in the distributed optimizer's dp_reshardable form (Megatron-LM's default: flat per-bucket buffers, the
chain's keys prefixed chained_0. / chained_1.) at TP1 EP2, TP2 EP2 and TP2 ETP1 EP2, and in the
fully_sharded_model_space form (N-D flattened DP slices, stored as megatron-core 0.15 did) at TP1 EP2;
it writes torch_dist for the target EP (one optimizer at EP 1, the chain at EP 2) and the torch format,
and megatron-core resumes each with the very losses the source run took next (a weights-only resume is
off by ~2e-2 at the second step, the first one the loaded moments move). With sigmoid routing and an expert
bias (a module buffer in no optimizer) the parameters' state is read and resumed alike, the bias carried as a
weight without slots.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, shared_followups
from test_dist_optim import _copy_with_args  # a copy of a save whose stored args say otherwise
from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.formats.registry import open_checkpoint
from ckptool.io.torchfile import load_torch_file
from ckptool.roles import is_parameter
from ckptool.write_options import WriteOptions

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_optim_dist_helper.py"
BF16 = "--dtype bf16"
SAVES = {"fr": ("--tp 1 --ep 2 --form fully_reshardable", 2), "plain": ("--tp 1 --ep 2 --form plain", 2),
         "tp2": ("--tp 2 --ep 2 --form fully_reshardable", 4),
         # dp_reshardable (Megatron-LM's default): flat buffers, the chain's keys prefixed chained_0. / chained_1.
         "dpr": ("--tp 1 --ep 2 --form dp_reshardable", 2),
         "dpr_tp2": ("--tp 2 --ep 2 --form dp_reshardable", 4),  # expert TP 2: expert buffers on a 2 x 2 grid
         "dpr_etp1": ("--tp 2 --ep 2 --etp 1 --form dp_reshardable", 4),  # dense TP 2, whole experts
         # PP 2 x EP 2, Qwen2-MoE-like: stage 0 (dense layer 0) has an expert optimizer with no buffers; the
         # helper steps on seeded random gradients (no pipeline schedule), so this save is checked, not resumed
         "dpr_pp2": ("--tp 1 --pp 2 --ep 2 --moe-arch qwen2moe --form dp_reshardable", 4),
         # the deprecated dp_zero_gather_scatter: the same buffers gathered over DP, one object per rank and optimizer
         "dz": ("--tp 1 --ep 2 --form dp_zero_gather_scatter", 2),
         # megatron-core <= 0.14's default (0.16 builds it, the helper stores it as 0.15 did): N-D flattened DP slices
         "fsms": ("--tp 1 --ep 2 --form fully_sharded_model_space", 2),
         # Qwen2-MoE-like: a dense layer 0, a shared expert with its gate, QKV biases (layers keyed by index)
         "qwen": ("--tp 1 --ep 2 --form fully_reshardable --moe-arch qwen2moe", 2),
         # sigmoid routing with an expert bias (--moe-router-enable-expert-bias): a module buffer in no optimizer
         "bias_fr": ("--tp 1 --ep 2 --form fully_reshardable --moe-arch biased", 2),
         "bias_dpr": ("--tp 1 --ep 2 --form dp_reshardable --moe-arch biased", 2)}
LIVE_CHECKED = ("fr", "plain", "tp2", "dpr", "dpr_tp2", "dpr_etp1", "fsms", "dpr_pp2", "dz", "bias_fr", "bias_dpr")  # test_distopt_moe.canonical_pieces knows the Mixtral-like names


def _next(path: Path):
    return torch.load(str(path) + ".losses")["next"]


# the saves as session framework runs (conftest.declare_runs): the 2-process ones join the launch of
# test_dist_optim.py's and test_dist_optim_groups.py's saves (the same helper), one start instead of two
SAVE_JOBS = {nproc: declare_runs(HELPER, nproc, {name: f"moe-save {{out}} {how} {BF16} --out {{out}}.pt"
                                                 for name, (how, n) in SAVES.items() if n == nproc})
             for nproc in (2, 4)}


def copy_saves(framework_runs, d: Path) -> Path:
    """The session's saves of SAVE_JOBS, copied into d."""
    for nproc, jobs in SAVE_JOBS.items():
        for name, stem in framework_runs(HELPER, nproc, jobs).items():
            copy_run(stem, d / name)
    return d


@pytest.fixture(scope="module")
def saved(tmp_path_factory, framework_runs):
    return copy_saves(framework_runs, tmp_path_factory.mktemp("dist_moe"))


@shared_followups
def resumed(framework_runs, d):
    """The saves (a copy of their own), ckptool's outputs at EP 1 / TP 2 / back at EP 2, megatron-core's resumes of
    them and of its own saves (controls), in one launch per helper and process count with the other files'
    follow-ups."""
    import test_moe_megatron
    copy_saves(framework_runs, d)
    said = []
    # (source, output, TP, EP, format): every conversion the resumes below start from
    for name, out, tp, ep, fmt in (("fr", "fr_ep1", 1, 1, "torch_dist"), ("plain", "plain_ep1", 1, 1, "torch_dist"),
                                   ("tp2", "tp2_ep1", 1, 1, "torch_dist"), ("fr_ep1", "back_ep2", 1, 2, "torch_dist"),
                                   ("fr", "torch_ep1", 1, 1, "torch"), ("qwen", "qwen_ep1", 1, 1, "torch_dist"),
                                   ("dpr", "dpr_ep1", 1, 1, "torch_dist"), ("fsms", "fsms_ep1", 1, 1, "torch_dist"),
                                   ("dpr_etp1", "dpr_etp1_ep1", 1, 1, "torch_dist"),
                                   ("bias_fr", "bias_fr_ep1", 1, 1, "torch_dist"),
                                   ("bias_dpr", "bias_dpr_ep1", 1, 1, "torch_dist"),
                                   # and at TP 2 (the expert bias is per expert: megatron-core's TP 2 model asks for it whole)
                                   ("bias_fr", "bias_fr_tp2", 2, 1, "torch_dist")):
        write_layout(open_checkpoint(d / name), d / out, Layout(tp, ep=ep), WriteOptions(format=fmt), warn=said.append)
    assert not said, said
    yield [(HELPER, 2, [
             f"moe-resume {d}/fr_ep1 --tp 1 --ep 1 --form fully_reshardable {BF16} --out {d}/r_fr_ep1.pt",
             f"moe-resume {d}/plain_ep1 --tp 1 --ep 1 --form plain {BF16} --out {d}/r_plain_ep1.pt",
             f"moe-resume {d}/tp2_ep1 --tp 1 --ep 1 --form fully_reshardable {BF16} --out {d}/r_tp2_ep1.pt",
             f"moe-resume {d}/back_ep2 --tp 1 --ep 2 --form fully_reshardable {BF16} --out {d}/r_back_ep2.pt",
             f"moe-resume {d}/fr --tp 1 --ep 2 --form fully_reshardable {BF16} --out {d}/r_control.pt",
             f"moe-resume {d}/fr_ep1 --tp 1 --ep 1 --form fully_reshardable {BF16} --weights-only "
             f"--out {d}/r_weights_only.pt",
             f"moe-resume {d}/qwen_ep1 --tp 1 --ep 1 --form fully_reshardable --moe-arch qwen2moe {BF16} "
             f"--out {d}/r_qwen_ep1.pt",
             f"moe-resume {d}/dpr_ep1 --tp 1 --ep 1 --form dp_reshardable {BF16} --out {d}/r_dpr_ep1.pt",
             f"moe-resume {d}/dpr_etp1_ep1 --tp 1 --ep 1 --form dp_reshardable {BF16} --out {d}/r_dpr_etp1_ep1.pt",
             f"moe-resume {d}/dpr --tp 1 --ep 2 --form dp_reshardable {BF16} --out {d}/r_dpr_control.pt",
             f"moe-resume {d}/fsms_ep1 --tp 1 --ep 1 --form fully_reshardable {BF16} --out {d}/r_fsms_ep1.pt",
             # (bias_dpr_ep1 is the same fully_reshardable output: read back, not resumed again)
             f"moe-resume {d}/bias_fr_ep1 --tp 1 --ep 1 --form fully_reshardable --moe-arch biased {BF16} "
             f"--out {d}/r_bias_fr_ep1.pt",
             f"moe-resume {d}/bias_fr_tp2 --tp 2 --ep 1 --form fully_reshardable --moe-arch biased {BF16} "
             f"--out {d}/r_bias_fr_tp2.pt"]),
           # the torch-format output, resumed as Megatron-LM's torch format loads (mcore_moe_helper.py resume), on
           # the source run's 2 processes as the torch_dist resumes above (DP 2 at EP 1)
           (test_moe_megatron.HELPER, 2, [f"resume {d}/torch_ep1 --tp 1 --ep 1 {BF16} --out {d}/r_torch_ep1.pt"])]
    return d


# megatron-core names test_distopt_moe.canonical_pieces does not know (the Qwen2-MoE-like model's), layer-local
QWEN_HALVES = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared."}
QWEN_DIRECT = {"mlp.linear_fc2.weight": "mlp.down.weight", "mlp.shared_experts.linear_fc2.weight": "mlp.shared.down.weight",
               "mlp.shared_experts.gate_weight": "mlp.shared_gate.weight"}


def pieces(name: str, value: torch.Tensor, cfg) -> dict:
    """{canonical name: the part of this megatron-core parameter's tensor it is} (global layer and expert)."""
    from test_distopt_moe import canonical_pieces
    from ckptool.roles import unfuse_qkv
    if name.startswith("decoder.layers."):
        _, _, layer, rest = name.split(".", 3)
        pre = f"layers.{layer}."
        if rest in QWEN_HALVES:
            gate, up = value.chunk(2, dim=0)
            return {pre + QWEN_HALVES[rest] + "gate.weight": gate, pre + QWEN_HALVES[rest] + "up.weight": up}
        if rest in QWEN_DIRECT:
            return {pre + QWEN_DIRECT[rest]: value}
        if rest == "self_attention.linear_qkv.bias":
            return dict(zip((pre + "attn.q.bias", pre + "attn.k.bias", pre + "attn.v.bias"), unfuse_qkv(value, cfg)))
    return canonical_pieces(name, value, cfg)


@pytest.mark.parametrize("name", LIVE_CHECKED)
def test_expert_optimizer_state_equals_the_live_optimizers(saved, name):
    from test_distopt_moe import SLOTS
    ck = open_checkpoint(saved / name)
    opt = ck.optimizer
    assert opt is not None and not ck.warnings, ck.warnings
    assert opt.step == 1 and opt.kind.startswith("megatron-core-dist")
    seen = set()
    for name_, tensors in torch.load(saved / f"{name}.pt.live")["live"].items():
        for key, slot in SLOTS.items():
            for canon, want in pieces(name_, tensors[key], ck.config).items():
                got = opt.slots[slot][canon].load()
                want = want[:got.shape[0]] if canon in ("embed.word", "output.weight") else want  # vocab padding
                assert got.dtype == torch.float32 and torch.equal(got, want.reshape(got.shape)), (name, canon, slot)
                seen.add(canon)
    # every parameter; a module buffer (the router's expert bias) is a weight with no slot
    assert seen == {n for n in ck.tensors if is_parameter(n)} and any(".mlp.experts.3." in n for n in seen)
    # the expert optimizer's group and its dense twin are one canonical group
    groups = {g.hyper["wd_mult"]: g.names for g in opt.param_groups}
    assert len(opt.param_groups) == 2 and "layers.1.mlp.experts.3.down.weight" in groups[1.0]


def test_written_chain_is_megatron_cores_for_the_target_ep(resumed, tmp_path):
    """EP 2: {0: dense, 1: expert} with the expert group flagged is_expert_parallel, as the run's own save;
    EP 1: one optimizer. Read back, every slot equals the source's."""
    d = resumed

    def groups(path):
        common = load_torch_file(next(path.glob("iter_*")) / "common.pt")["optimizer"]
        parts = [common[k] for k in sorted(common)] if 0 in common else [common]
        return [[(g["wd_mult"], g["is_expert_parallel"]) for g in p["optimizer"]["param_groups"]] for p in parts]

    assert groups(d / "back_ep2") == groups(d / "fr") == [[(1.0, False), (0.0, False)], [(1.0, True)]]
    assert groups(d / "fr_ep1") == [[(1.0, False), (0.0, False)]]
    # the torch-format output (its rank files tied by the torch reader) back into torch_dist at EP 2
    write_layout(open_checkpoint(d / "torch_ep1"), tmp_path / "again", Layout(1, ep=2),
                 WriteOptions(format="torch_dist"), warn=print)
    assert groups(tmp_path / "again") == groups(d / "fr")
    src = open_checkpoint(d / "fr").optimizer
    for out in ("back_ep2", "fr_ep1", "torch_ep1", tmp_path / "again"):
        back = open_checkpoint(d / out).optimizer
        for slot, tensors in src.slots.items():
            assert all(torch.equal(t.load(), back.slots[slot][n].load()) for n, t in tensors.items()), (out, slot)


@pytest.mark.parametrize("run,src", [("r_fr_ep1", "fr"), ("r_plain_ep1", "plain"), ("r_tp2_ep1", "tp2"),
                                     ("r_back_ep2", "fr"), ("r_torch_ep1", "fr"), ("r_qwen_ep1", "qwen"),
                                     ("r_dpr_ep1", "dpr"), ("r_dpr_etp1_ep1", "dpr_etp1"), ("r_fsms_ep1", "fsms"),
                                     ("r_bias_fr_ep1", "bias_fr"), ("r_bias_fr_tp2", "bias_fr")])
def test_moe_optimizer_resumes_at_another_expert_layout(resumed, run, src):
    """EP 2 -> EP 1 (both optimizer kinds; from TP2 too; the Qwen2-MoE-like model), EP 2 -> EP 1 -> EP 2,
    and into the torch format: the next two losses are the source run's; a fresh optimizer's second
    loss is not."""
    went_on, got = _next(resumed / f"{src}.pt"), _next(resumed / f"{run}.pt")
    fresh = abs(_next(resumed / "r_weights_only.pt")[1] - _next(resumed / "fr.pt")[1])
    gap = max(abs(a - b) for a, b in zip(got, went_on))
    print(f"MoE torch_dist {src} -> {run}: losses {got} vs {went_on} (gap {gap:.1e}); weights-only {fresh:.2e}")
    assert gap <= (2e-3 if src in ("tp2", "dpr_etp1") or run.endswith("_tp2") else 0.0) and fresh > 1e-3
    assert _next(resumed / "r_control.pt") == _next(resumed / "fr.pt")
    assert _next(resumed / "r_dpr_control.pt") == _next(resumed / "dpr.pt")  # megatron-core resuming its dp_reshardable save


@pytest.mark.parametrize("name, out", [("bias_fr", "bias_fr_ep1"), ("bias_dpr", "bias_dpr_ep1"),
                                       ("bias_fr", "bias_fr_tp2")])
def test_expert_bias_is_a_weight_without_optimizer_state(resumed, name, out):
    """megatron-core's TopKRouter.expert_bias is a buffer: saved with the model, in no optimizer (no
    optimizer.state.* key, no place in the flat buffers). ckptool reads it as a weight without slots, writes
    no optimizer state for it at EP 1 (TP 1 and TP 2: megatron-core resumes the TP 2 output), and carries
    its values bit for bit."""
    src, out_dir = open_checkpoint(resumed / name), resumed / out
    out = open_checkpoint(out_dir)
    biases = [n for n in src.tensors if n.endswith("router.expert_bias")]
    assert biases == ["layers.0.mlp.router.expert_bias", "layers.1.mlp.router.expert_bias"]
    for n in biases:
        bias = src.tensors[n].load()
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # megatron-core keeps it fp32 in a bf16 model
        assert torch.equal(out.tensors[n].load(), bias)
        assert all(n not in slots for ck in (src, out) for slots in ck.optimizer.slots.values())
        assert all(n not in g.names for ck in (src, out) for g in ck.optimizer.param_groups)
    assert not [k for k in _dcp_keys(out_dir) if k.startswith("optimizer.") and "expert_bias" in k]


def test_dp_reshardable_moe_optimizer_is_the_chain_of_flat_buffers(saved):
    """Megatron-LM's default distributed form for MoE: at EP 2 the chain's flat buffers under chained_0.
    (dense, dp_group_idx = the TP x PP rank) and chained_1. (experts, dp_group_idx = the rank in the expert
    TP x EP x PP group), each laid out by megatron-core's buffer rules; read with nothing dropped (the
    values: test_expert_optimizer_state_equals_the_live_optimizers)."""
    def groups(name):
        return sorted({k.split(".gbuf_idx_")[0] for k in _dcp_keys(saved / name) if ".gbuf_idx_" in k})

    assert groups("dpr_tp2") == [f"chained_0.optimizer.distributed.dp_group_idx_{i}" for i in range(2)] + \
        [f"chained_1.optimizer.distributed.dp_group_idx_{i}" for i in range(4)]  # TP 2; expert TP 2 x EP 2
    assert groups("dpr_etp1") == [f"chained_{n}.optimizer.distributed.dp_group_idx_{i}" for n in (0, 1) for i in range(2)]
    for name in ("dpr", "dpr_tp2", "dpr_etp1"):
        ck = open_checkpoint(saved / name)
        assert not ck.warnings and ck.optimizer.kind == "megatron-core-dist (dp_reshardable)", (name, ck.warnings)


def test_dp_reshardable_moe_with_args_claiming_another_expert_grid_is_refused(saved, tmp_path):
    """args claiming expert TP 1 for a save at expert TP 2: the expert buffers recomputed for whole experts
    do not give the stored bucket sizes; refused in one line suggesting --no-optimizer."""
    from ckptool.errors import CkptError
    with pytest.raises(CkptError, match=r"chained_1\.optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_0 holds "
                                        r"buckets of .*--no-optimizer"):
        open_checkpoint(_copy_with_args(saved / "dpr_tp2", tmp_path, expert_tensor_parallel_size=1))


def test_dp_reshardable_legacy_grouped_mlp_is_dropped_by_name(saved, tmp_path):
    """The legacy GroupedMLP (one parameter per fc for all local experts) is not laid out: dropped with a
    warning naming it; the weights still read."""
    ck = open_checkpoint(_copy_with_args(saved / "dpr", tmp_path, moe_grouped_gemm=True))
    assert ck.optimizer is None and any("optimizer state dropped" in w and "legacy GroupedMLP" in w
                                        for w in ck.warnings), ck.warnings


def _dcp_keys(path: Path):
    from ckptool.io.dcp_io import DcpDir
    return DcpDir(next(path.glob("iter_*"))).entries
