"""Megatron's distributed optimizer (distrib_optim.pt) read and written, proven with the real megatron-core.

- The grad-buffer layout ckptool recomputes equals the one megatron-core 0.16's own _ParamAndGradBuffer
  builds (random parameter sizes, DP sizes, bucket sizes, shared-embedding buckets).
- A TP1 DP2 run with megatron-core's DistributedOptimizer (CPU, gloo; tests/mcore_train_helper.py)
  saves Megatron-LM's torch format; ckptool's masters and moments equal what the live optimizer held;
  the same for a TP1 PP2 DP2 run (tied embeddings: the head copy on the last stage), whose
  distrib_optim.pt files ckptool also writes back identically.
- Resharded to the non-distributed layout at TP2, training resumes like the run that went on (DP and TP
  change the reduction order: within the noise test_resume.py measures), unlike a weights-only resume.
- Written back with --distributed-optimizer, the real megatron-core loads it with load_state_dict +
  load_parameter_state: at the source's layout (TP1 DP2) the resumed run equals the run that went on
  bit for bit; at TP2 DP1 within the noise.
- A corrupted numel_unpadded, values shifted within the file (a master that no longer rounds to its
  weight) or a missing distrib_optim.pt is refused in one line naming --no-optimizer.
- Written bucketed for a target run with --overlap-grad-reduce --ddp-bucket-size (TP1 DP2, and TP1 PP2 DP2
  where stage 0 is cut beside the embedding's own bucket), the real megatron-core
  run with those flags resumes from it exactly; megatron-core's own bucketed save reads equal to its live
  optimizer; the older eras' forms (2024-02 bucket list, 2024-04/05 coalesced) round-trip bit for bit.
- The flat tensors are written a parameter at a time (FlatSlot chunks), never built whole.
"""
from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.errors import CkptError
from ckptool.formats.megatron import distopt as D
from ckptool.formats.megatron.names import DIALECTS, KeyMatcher
from ckptool.formats.registry import open_checkpoint
from ckptool.roles import global_role_tensor, layer_role_tensor
from ckptool.write_options import WriteOptions
from conftest import copy_run, declare_runs, shared_followups
from test_resume import HELPER, LOSS_TOL, REPO, ckptool, losses, torchrun, weight_gap

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed "
                                "(pip install megatron-core: test-only extra)")
STEPS, MORE = 3, 2
DIST = "--distributed-optimizer"


def test_buffer_layout_matches_megatron_core():
    """buffer_layout (current era) against megatron-core's own _ParamAndGradBuffer, element for element."""
    import megatron.core.distributed.param_and_grad_buffer as pgb
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    class Group:  # the buffer only asks a process group for its size (and rank 0 for logging)
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

        def rank(self):
            return 0

    patches = {"log": (pgb, "log_on_each_pipeline_stage", lambda *a, **k: None),
               "device": (torch.cuda, "current_device", lambda: "cpu")}  # CPU torch: buffers on the CPU
    saved = {k: getattr(m, n) for k, (m, n, _) in patches.items()}
    for m, n, f in patches.values():
        setattr(m, n, f)
    try:
        rng = random.Random(0)
        for case in range(120):
            numels = [rng.choice([1, 7, 32, 64, 100, 1000, 4096]) for _ in range(rng.randint(1, 12))]
            shared = [False] * len(numels)
            shared[0] = rng.random() < 0.5  # the word embedding on the first stage
            shared[-1] = shared[-1] or rng.random() < 0.3  # the head copy on the last stage
            dp, bucket = rng.choice([1, 2, 3, 8]), rng.choice([None, 100, 2000])
            params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
            for p, s in zip(params, shared):
                if s:
                    p.shared_embedding = True
            pg = ProcessGroupCollection()
            pg.tp, pg.dp_cp = Group(1), Group(dp)
            buf = pgb._ParamAndGradBuffer(DistributedDataParallelConfig(use_distributed_optimizer=True),
                                          torch.float32, torch.float32, params, Group(dp), bucket,
                                          {p: str(i) for i, p in enumerate(params)}, 1.0 / dp,
                                          list(range(len(params))), False, pg)
            ours = D.buffer_layout(numels, shared, D.CURRENT, dp, bucket)
            starts = [b.offset for b in buf.buckets]
            for i, p in enumerate(params):
                start, _, b = buf.param_index_map[p]
                assert (b, start - starts[b]) == (ours.bucket_of[i], ours.start[i]), (case, i)
            assert [b.numel_unpadded for b in buf.buckets] == ours.bucket_unpadded, case
            assert [b.grad_data.numel() for b in buf.buckets] == ours.bucket_padded, case
    finally:
        for k, (m, n, _) in patches.items():
            setattr(m, n, saved[k])


# megatron-core's DistributedOptimizer at TP1 x DP2 (test_quick_inspect reads it too: run once per session)
TRAIN = f"train {{out}} --tp 1 --dp 2 {DIST} --steps {STEPS} --more {MORE} --out {{out}}.pt"
declare_runs(HELPER, 2, {"a": TRAIN})


@shared_followups
def runs(framework_runs, d):
    """The TP1 x DP2 training copied, ckptool's outputs from it, megatron-core's resumes of them (in one launch with
    the other files' 2-process follow-ups of the helper)."""
    copy_run(framework_runs(HELPER, 2, {"a": TRAIN}, timeout=300)["a"], d / "a")
    assert "non-distributed layout" in ckptool("reshard", d / "a", d / "b2", "--tp", "2").stdout
    ckptool("reshard", d / "a", d / "w2", "--tp", "2", "--no-optimizer")
    out = ckptool("reshard", d / "a", d / "c1", "--tp", "1", DIST, "--dp", "2").stdout
    assert "distrib_optim.pt files for DP 2" in out
    ckptool("reshard", d / "a", d / "e2", "--tp", "2", DIST, "--dp", "1")
    # test_bucketed_target_resumes_in_megatron_core's runs: ckptool's bucketed file resumed, and a bucketed
    # megatron-core run of its own (in this launch: one start of megatron-core for both tests)
    size = bucket_size(d / "a")[0]
    ckptool("reshard", d / "a", d / "ob", "--tp", "1", DIST, "--dp", "2", "--overlap-grad-reduce",
            "--ddp-bucket-size", str(size))
    yield [(HELPER, 2, [f"resume {d}/b2 --tp 2 --more {MORE} --out {d}/b2.pt",
                        f"resume {d}/w2 --tp 2 --more {MORE} --out {d}/w2.pt --weights-only",
                        f"resume {d}/c1 --tp 1 --dp 2 {DIST} --more {MORE} --out {d}/c1.pt",
                        f"resume {d}/e2 --tp 2 --dp 1 {DIST} --more {MORE} --out {d}/e2.pt",
                        f"train {d}/o --tp 1 --dp 2 {DIST} --ddp-bucket-size {size} --steps {STEPS} --more 0 "
                        f"--out {d}/o.pt",
                        f"resume {d}/ob --tp 1 --dp 2 {DIST} --ddp-bucket-size {size} --more {MORE} --out {d}/ob.pt"])]
    return d


def bucket_size(run: Path) -> tuple:
    """(bucket size, parameter sizes, unbucketed numel_unpadded) for the bucketed tests of the TP1 DP2 run:
    a bucket size that moves parameters (a bucket ending off the 64-element alignment): the tiny model's
    sizes are mostly multiples of 64, where the coalesced form would not show the buckets."""
    model = torch.load(run / "iter_0000003/mp_rank_00/model_optim_rng.pt", weights_only=False)["model"]
    numels = [p.numel() for k, p in model.items() if isinstance(p, torch.Tensor) and not k.endswith("_extra_state")]
    unbucketed = D.buffer_layout(numels, [False] * len(numels), D.CURRENT, 2, None).numel_unpadded
    size = next(b for b in range(1000, 10000, 100)
                if D.buffer_layout(numels, [False] * len(numels), D.CURRENT, 2, b).numel_unpadded != unbucketed)
    return size, numels, unbucketed


def test_reader_equals_the_live_optimizer(runs):
    """Every parameter's fp32 master and Adam moments, as ckptool reads them from distrib_optim.pt,
    equal what megatron-core's live DistributedOptimizer held (gathered by its own range maps)."""
    ckpt = open_checkpoint(runs / "a")
    opt = ckpt.optimizer
    assert opt.kind == "megatron-distributed" and opt.step == STEPS and not ckpt.warnings
    assert [len(g.names) for g in opt.param_groups] == [14, 22]  # weights | biases and norms
    live = torch.load(runs / "a.pt", weights_only=False)["live"]
    assert list(live) == [(0, 0)] and len(live[(0, 0)]) == 28
    assert_equals_live(ckpt, live[(0, 0)])


def assert_equals_live(ckpt, live):
    matcher = KeyMatcher(DIALECTS["mcore"])
    for key, values in live.items():
        role, layer = matcher.match(key)
        for file_key, slot in D.SLOT_OF_KEY.items():
            tensors = ckpt.optimizer.slots[slot]
            fused = global_role_tensor(tensors, role) if layer is None else \
                layer_role_tensor(tensors, ckpt.config, layer, role)
            assert torch.equal(fused.load().reshape(-1), values[file_key]), (key, slot)


def test_pipeline_stages_read_and_written_like_megatron_core(tmp_path):
    """TP1 PP2 DP2 with tied embeddings: each stage's grad buffer (the last stage's holds the head copy
    of the word embedding, which megatron-core buckets alone) read equal to the live optimizer, and
    ckptool's distrib_optim.pt at the same layout equals megatron-core's tensor for tensor. Written
    bucketed (--overlap-grad-reduce: stage 0 cut into buckets beside the embedding's own, stage 1
    not), the real megatron-core run with those flags resumes from it like the run that went on."""
    d = tmp_path
    torchrun(4, f"train {d}/p --tp 1 --pp 2 --dp 2 {DIST} --steps 2 --more {MORE} --out {d}/p.pt")
    live = torch.load(d / "p.pt", weights_only=False)["live"]
    assert sorted(live) == [(0, 0), (0, 1)]
    head, word = live[(0, 1)].pop("output_layer.weight"), live[(0, 0)]["embedding.word_embeddings.weight"]
    assert all(torch.equal(head[k], word[k]) for k in D.KEYS)  # the copies stay in sync
    ckpt = open_checkpoint(d / "p")
    assert ckpt.optimizer.kind == "megatron-distributed" and ckpt.optimizer.step == 2
    assert_equals_live(ckpt, {**live[(0, 0)], **live[(0, 1)]})
    ckptool("reshard", d / "p", d / "q", "--tp", "1", "--pp", "2", DIST, "--dp", "2")
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        src = torch.load(d / "p/iter_0000002" / stage / D.FILE, weights_only=False)
        ours = torch.load(d / "q/iter_0000002" / stage / D.FILE, weights_only=False)
        assert src.keys() == ours.keys() and src[0].keys() == ours[0].keys()
        for key, value in next(iter(src[0].values())).items():
            mine = next(iter(ours[0].values()))[key]
            assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, (stage, key)
    size = 1500
    ckptool("reshard", d / "p", d / "b", "--tp", "1", "--pp", "2", DIST, "--dp", "2", "--overlap-grad-reduce",
            "--ddp-bucket-size", str(size))
    model = torch.load(d / "b/iter_0000002/mp_rank_00_000/model_optim_rng.pt", weights_only=False)["model"]
    keys = [k for k, v in model.items() if isinstance(v, torch.Tensor)]
    stage0 = D.buffer_layout([model[k].numel() for k in keys], [k == "embedding.word_embeddings.weight" for k in keys],
                             D.CURRENT, 2, size)
    assert len(stage0.bucket_unpadded) >= 3  # the embedding's own bucket and at least two more
    torchrun(4, f"resume {d}/b --tp 1 --pp 2 --dp 2 {DIST} --ddp-bucket-size {size} --more {MORE} --out {d}/b.pt")
    gap = (losses(d / "b.pt") - losses(d / "p.pt")[2:]).abs().max().item()
    print(f"TP1 PP2 DP2 bucketed by ckptool, resumed bucketed: loss gap {gap:.2e}")
    assert gap == 0.0


def test_older_forms_by_era(runs, tmp_path):
    """The forms before today's, built from the live values by their documented rules (parameters in
    reverse registration order, packed without alignment): the 2024-04..06 coalesced form and the
    2024-02..03 per-bucket list (each bucket padded to a multiple of DP) are read; older is refused."""
    live = torch.load(runs / "a.pt", weights_only=False)["live"][(0, 0)]
    rank = torch.load(runs / "a/iter_0000003/mp_rank_00/model_optim_rng.pt", weights_only=False)
    order = [k for k, v in rank["model"].items() if isinstance(v, torch.Tensor) and k in live]
    assert len(order) == len(live)  # registration order = the rank file's key order
    packed = {key: torch.cat([live[k][key] for k in reversed(order)]) for key in D.KEYS}
    n = packed["param"].numel()
    forms = {
        "coalesced": {"buckets_coalesced": True,
                      0: {torch.bfloat16: dict(packed, numel_unpadded=n)}},
        "bucket-list": {"per_bucket_numel": [{torch.bfloat16: [n + n % 2]}],
                        "per_bucket_numel_unpadded": [{torch.bfloat16: [n]}],
                        0: {torch.bfloat16: {k: [torch.cat([v, torch.zeros(n % 2)])] for k, v in packed.items()}}},
        "2023": {0: {torch.float32: {k: [v] for k, v in packed.items()}}},
    }
    for name, state in forms.items():
        d = _copy(runs / "a", tmp_path / name)
        torch.save(state, d / "iter_0000003/mp_rank_00/distrib_optim.pt")
        if name == "2023":
            _refused(d, "before 2024-02")
        else:
            assert_equals_live(open_checkpoint(d), live)


def test_non_distributed_tp2_resumes_like_the_run_that_went_on(runs):
    went_on = losses(runs / "a.pt")[STEPS:]
    gap = (losses(runs / "b2.pt") - went_on).abs().max().item()
    gap_weights_only = (losses(runs / "w2.pt") - went_on).abs().max().item()
    print(f"TP1 DP2 distributed -> TP2 non-distributed: loss gap {gap:.2e}, weights-only {gap_weights_only:.2e}")
    assert gap < LOSS_TOL and gap_weights_only > 10 * max(gap, 1e-5)
    w_gap = weight_gap(runs / "a_continued", runs / "b2_resumed_tp2")
    w_gap_weights_only = weight_gap(runs / "a_continued", runs / "w2_weights_only_tp2")
    print(f"weight gap {w_gap:.2e}, weights-only {w_gap_weights_only:.2e}")
    assert w_gap < 0.25 * w_gap_weights_only


def test_written_distrib_optim_loads_into_megatron_core(runs):
    """ckptool's distrib_optim.pt at the source's layout is the source's, tensor for tensor, and the
    real megatron-core resumes from it exactly (which also proves the helper's save/load path exact:
    the same-layout control); at TP2 DP1 within the reduction-order noise."""
    src = torch.load(runs / "a/iter_0000003/mp_rank_00/distrib_optim.pt", weights_only=False)
    ours = torch.load(runs / "c1/iter_0000003/mp_rank_00/distrib_optim.pt", weights_only=False)
    assert src.keys() == ours.keys() and src[0].keys() == ours[0].keys()
    for key, value in next(iter(src[0].values())).items():
        mine = next(iter(ours[0].values()))[key]
        assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, key
    went_on = losses(runs / "a.pt")[STEPS:]
    assert torch.equal(losses(runs / "c1.pt"), went_on)
    assert weight_gap(runs / "a_continued", runs / "c1_resumed_tp1") == 0.0
    gap = (losses(runs / "e2.pt") - went_on).abs().max().item()
    print(f"TP1 DP2 -> TP2 DP1, distributed optimizer written by ckptool: loss gap {gap:.2e}")
    assert gap < LOSS_TOL
    back = open_checkpoint(runs / "e2")
    assert back.optimizer.kind == "megatron-distributed" and back.optimizer.step == STEPS


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(src: Path, *words: str) -> str:
    """Opening src fails with one CkptError line naming words and suggesting --no-optimizer."""
    with pytest.raises(CkptError) as e:
        open_checkpoint(src)
    line = str(e.value)
    assert "\n" not in line and "--no-optimizer" in line, line
    for w in words:
        assert w in line, line
    return line


def test_corrupt_or_missing_distrib_optim_is_refused(runs, tmp_path):
    bad = _copy(runs / "a", tmp_path / "bad")
    f = bad / "iter_0000003/mp_rank_00/distrib_optim.pt"
    state = torch.load(f, weights_only=False)
    entry = next(iter(state[0].values()))
    for key in D.KEYS:  # consistent with itself, but not with this model's buffer
        entry[key] = entry[key][:-64].clone()
    entry["numel_unpadded"] -= 64
    torch.save(state, f)
    _refused(bad, "numel_unpadded", "distrib_optim.pt", "matches no megatron-core buffer layout")
    entry["numel_unpadded"] += 64  # now the number disagrees with the tensors themselves
    torch.save(state, f)
    _refused(bad, "numel_unpadded")
    state = torch.load(runs / "a/iter_0000003/mp_rank_00/distrib_optim.pt", weights_only=False)
    entry = next(iter(state[0].values()))
    entry["param"] = entry["param"].roll(64)  # right sizes, values one slot off: a mis-tie to catch
    torch.save(state, f)
    ckpt = open_checkpoint(bad)
    with pytest.raises(CkptError, match=r"distrib_optim.pt: the fp32 master of .* does not round.*--no-optimizer"):
        for master in ckpt.optimizer.slots["master"].values():
            master.load()
    f.unlink()
    _refused(bad, "distrib_optim.pt", "missing")
    r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(bad), str(tmp_path / "o"), "--tp", "2"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert r.returncode == 2 and not (tmp_path / "o").exists()
    assert r.stderr.count("error:") == 1 and "--no-optimizer" in r.stderr, r.stderr
    ckptool("reshard", bad, tmp_path / "weights", "--tp", "2", "--no-optimizer")  # the hint works
    assert open_checkpoint(tmp_path / "weights").optimizer is None


BUCKETED = dict(overlap_grad_reduce=True, ddp_bucket_size=3000)  # several buckets on stage 0, chunk 0


@pytest.mark.parametrize("layout,dp,options", [
    (Layout(1, 1), 3, {}), (Layout(1, 2), 4, {}), (Layout(2, 2, vpp=2), 2, {}),
    (Layout(1, 2), 4, dict(BUCKETED, distrib_optim_era="2024-02")),
    (Layout(2, 2, vpp=2), 3, dict(BUCKETED, distrib_optim_era="2024-05")),
    (Layout(1, 1), 2, dict(BUCKETED, distrib_optim_era="2024-04"))],
    ids=["tp1pp1-dp3", "tp1pp2-dp4", "tp2pp2vpp2-dp2", "tp1pp2-dp4-bucketed-2024-02",
         "tp2pp2vpp2-dp3-bucketed-2024-05", "tp1pp1-dp2-bucketed-2024-04"])
def test_real_megatron_lm_state_through_distrib_optim(tmp_path, layout, dp, options):
    """A real Megatron-LM checkpoint (non-distributed optimizer, TP2 PP2, tied embeddings) written with
    the distributed optimizer at other layouts (PP > 1: shared-embedding buckets; VPP: one buffer per
    chunk), also bucketed in the older eras' forms, and read back: every master and moment is the
    source's; back to the non-distributed source layout, the rank files' optimizer entries are the
    source's, index by index."""
    from conftest import real_checkpoint
    from test_optimizer import CASES, _assert_rank_files_equal, assert_same_training_state
    src_dir = real_checkpoint(CASES[0]) / "checkpoint"
    src = open_checkpoint(src_dir)
    summary = write_layout(src, tmp_path / "dist", layout,
                           WriteOptions(distributed_optimizer=True, dp=dp, **options), warn=lambda m: None)
    bucketing = {"bucket_size": 3000, "era": options["distrib_optim_era"]} if options else {}
    assert summary["optimizer"]["distributed"] == {"dp": dp, **bucketing}
    rank_dirs = sorted((tmp_path / "dist" / "iter_0000003").iterdir())
    assert len(rank_dirs) == layout.tp * layout.pp and all((d / D.FILE).is_file() for d in rank_dirs)
    out = open_checkpoint(tmp_path / "dist")
    assert out.optimizer.kind == "megatron-distributed" and out.source.args.data_parallel_size == dp
    first = torch.load(rank_dirs[0] / D.FILE, weights_only=False)
    if options:  # the first stage's chunk 0 is cut into buckets, the form is the era's
        assert out.source.args.overlap_grad_reduce and out.source.args.ddp_bucket_size == 3000
        era = D.ERA_BY_SINCE[options["distrib_optim_era"]]
        assert ("buckets_coalesced" in first) == (era.form == "coalesced")
    assert_same_training_state(src, out)
    write_layout(out, tmp_path / "back", src.source.layout, warn=lambda m: None)
    _assert_rank_files_equal(src_dir / "iter_0000003", tmp_path / "back" / "iter_0000003")


def test_flat_tensors_stream_a_parameter_at_a_time(monkeypatch):
    """A distrib_optim.pt flat tensor (FlatSlot) comes out in chunks equal to the whole tensor built at
    once (each slot at its offset, zeros in the gaps); the parameters' slots are loaded at most AHEAD
    bytes (and a parameter or two) ahead of the writer, and at most a chunk (or one large parameter) is
    out at a time: the rank's buffer is never in memory whole."""
    from ckptool.lazy import Const, Derived
    monkeypatch.setattr(D, "CHUNK", 1000)
    monkeypatch.setattr(D, "AHEAD", 4000)  # bytes: one 1000-element fp32 slot
    rng = random.Random(5)
    loaded, out = [], []

    def slot(i, n):
        t = torch.randn(n, generator=torch.Generator().manual_seed(i))
        return Derived(lambda x, i=i: loaded.append(i) or x, [Const(t)], shape=t.shape, dtype=t.dtype), t

    numels = [rng.choice([3, 64, 700, 999, 1000, 2500]) for _ in range(14)]
    layout = D.buffer_layout(numels, [False] * len(numels), D.CURRENT, 4, 3000)
    pieces, whole = [], torch.zeros(layout.numel_unpadded)
    for i, n in enumerate(numels):
        lazy, t = slot(i, n)
        off = layout.coalesced_offset(i)
        pieces.append((off, lazy))
        whole[off:off + n] = t
    flat = D.FlatSlot(pieces, layout.numel_unpadded)
    written = 0
    for chunk in flat.chunks():
        assert chunk.numel() <= max(1000, max(numels))
        written += chunk.numel()
        # slots loaded whose place the writer has not reached: within AHEAD and two slots
        early = sum(4 * numels[i] for i in list(loaded) if pieces[i][0] >= written)
        assert early <= D.AHEAD + 2 * 4 * max(numels), (early, written)
        out.append((len(loaded), chunk.clone()))
    assert torch.equal(torch.cat([c for _, c in out]), whole) and torch.equal(flat.load(), whole)
    assert sorted(loaded[:len(numels)]) == list(range(len(numels)))  # once each (flat.load() loads again)
    # loads are interleaved with the chunks: the first chunk went out before the last slot was loaded
    assert out[0][0] < len(numels) and out[-1][0] == len(numels)


def test_bucketed_target_resumes_in_megatron_core(runs, tmp_path):
    """--overlap-grad-reduce --ddp-bucket-size: the written distrib_optim.pt has the bucketed layout
    (several buckets, placed unlike the one-bucket file), the args say so, and the real megatron-core
    run with those flags loads it and resumes exactly like the run that went on; a megatron-core run
    of its own with buckets is read equal to its live optimizer; the bucketed file reads back bit for
    bit, and written back without buckets it is the source's file again. The bucket-list form of
    megatron-core 2024-02..03 is written and read back bit for bit too."""
    d = tmp_path
    rank = "iter_0000003/mp_rank_00"
    size, numels, unbucketed = bucket_size(runs / "a")
    layout = D.buffer_layout(numels, [False] * len(numels), D.CURRENT, 2, size)
    assert len(layout.bucket_unpadded) >= 2
    bucket = ["--overlap-grad-reduce", "--ddp-bucket-size", str(size)]
    # runs/ob: `ckptool reshard runs/a --tp 1 --distributed-optimizer --dp 2 *bucket` (the runs fixture,
    # which also resumed it and ran megatron-core's own bucketed run runs/o)
    ours = torch.load(runs / "ob" / rank / D.FILE, weights_only=False)
    src = torch.load(runs / "a" / rank / D.FILE, weights_only=False)
    args = torch.load(runs / "ob" / rank / "model_optim_rng.pt", weights_only=False)["args"]
    assert args.overlap_grad_reduce is True and args.ddp_bucket_size == size
    assert next(iter(ours[0].values()))["numel_unpadded"] == layout.numel_unpadded != unbucketed
    went_on = losses(runs / "a.pt")[STEPS:]
    assert torch.equal(losses(runs / "ob.pt"), went_on)
    assert weight_gap(runs / "a_continued", runs / "ob_resumed_tp1") == 0.0
    assert_equals_live(open_checkpoint(runs / "o"), torch.load(runs / "o.pt", weights_only=False)["live"][(0, 0)])
    back = open_checkpoint(runs / "ob")
    assert_same_slots(open_checkpoint(runs / "a"), back)
    ckptool("reshard", runs / "ob", d / "oa", "--tp", "1", DIST, "--dp", "2", "--no-overlap-grad-reduce")
    again = torch.load(d / "oa" / rank / D.FILE, weights_only=False)
    for key, value in next(iter(src[0].values())).items():
        mine = next(iter(again[0].values()))[key]
        assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, key
    ckptool("reshard", runs / "a", d / "old", "--tp", "1", DIST, "--dp", "2", *bucket, "--distrib-optim-era", "2024-02")
    old = torch.load(d / "old" / rank / D.FILE, weights_only=False)
    lists = next(iter(old[0].values()))
    assert "buckets_coalesced" not in old and len(lists["param"]) >= 2
    assert [t.numel() for t in lists["exp_avg"]] == next(iter(old["per_bucket_numel"][0].values()))
    assert_same_slots(back, open_checkpoint(d / "old"))


def assert_same_slots(a, b):
    for slot in D.SLOT_OF_KEY.values():
        assert a.optimizer.slots[slot].keys() == b.optimizer.slots[slot].keys()
        for name, t in a.optimizer.slots[slot].items():
            assert torch.equal(t.load(), b.optimizer.slots[slot][name].load()), (slot, name)


def test_bucket_options_need_their_flags(tmp_path):
    """The target run's bucketing options are refused, in one line naming the missing flag, where they
    would shape nothing: without --distributed-optimizer, or a bucket size without --overlap-grad-reduce."""
    from ckptool import api
    from conftest import real_checkpoint
    from test_optimizer import CASES
    src = real_checkpoint(CASES[0]) / "checkpoint"
    for kw, words in ((dict(overlap_grad_reduce=True), "give it with --distributed-optimizer"),
                      (dict(distrib_optim_era="2024-02"), "give it with --distributed-optimizer"),
                      (dict(distributed_optimizer=True, ddp_bucket_size=1000), "add --overlap-grad-reduce")):
        with pytest.raises(CkptError) as e:
            api.reshard(src, tmp_path / "out", tp=1, warn=lambda m: None, **kw)
        assert words in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()


def test_written_args_say_the_bucketing_the_layout_follows():
    """The target's args after set_bucket_args: the options win over the source run's settings, the
    source's stay otherwise, and a source cut by --ddp-num-buckets (not laid out by ckptool) is refused
    unless the target's size or --no-overlap-grad-reduce is given."""
    import argparse
    source = dict(overlap_grad_reduce=True, ddp_bucket_size=None, ddp_num_buckets=4)
    with pytest.raises(CkptError, match="--ddp-num-buckets 4"):
        D.set_bucket_args(argparse.Namespace(**source), None, None)
    args = argparse.Namespace(**source)
    D.set_bucket_args(args, None, 5000)
    assert (args.overlap_grad_reduce, args.ddp_bucket_size, args.ddp_num_buckets) == (True, 5000, None)
    assert D.target_bucket_size(args, 0, 0, 2) == 5000 and D.target_bucket_size(args, 1, 0, 2) is None
    assert D.target_bucket_size(args, 0, 1, 2) is None  # only the first stage's first chunk is cut
    args = argparse.Namespace(**source)
    D.set_bucket_args(args, False, None)
    assert args.overlap_grad_reduce is False and D.target_bucket_size(args, 0, 0, 2) is None
    args = argparse.Namespace(overlap_grad_reduce=True, ddp_bucket_size=None)
    D.set_bucket_args(args, None, None)
    assert D.target_bucket_size(args, 0, 0, 64) == 64_000_000  # megatron-core's max(40M, 1M x DP)
