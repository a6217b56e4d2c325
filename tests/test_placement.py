"""Placement declared by the pieces the split / fuse path makes (the code writers and verify run):
every piece says which whole it is cut from, under which canonical names, and where (its blocks);
the declared blocks are the data; verify's rank view of a merged source is the writer's rank file,
bit for bit; a gated fc1 rank piece reads only its rows of gate and up."""
import pytest
import torch

from ckptool.config import GPTConfig, Layout
from ckptool.lazy import Const, LazyTensor, load_scope
from ckptool.roles import assemble, fuse_qkv, layer_role_tensor, qkv_blocks, shard_role
from ckptool.sharding import Rule, split, split_lazy
from ckptool.state import Checkpoint, SourceInfo, expected_names
from ckptool.write_options import WriteOptions


def blocks_of(piece) -> torch.Tensor:
    """The piece as its placement declares it: its blocks of the whole, concatenated."""
    p = piece.placement
    whole = p.whole.load()
    return torch.cat([whole.narrow(p.dim, o, n) for o, n in p.blocks], dim=p.dim)


def cfg_of(heads=8, groups=2, gated=True, **kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups, ffn_hidden_size=48,
                padded_vocab_size=128, vocab_size=100, max_position_embeddings=16, normalization="rmsnorm",
                position_embedding="rope", add_bias_linear=False, add_qkv_bias=False, tied_embeddings=False,
                make_vocab_size_divisible_by=8, activation="swiglu" if gated else "gelu")
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("rule", list(Rule))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rule_declares_where_its_pieces_sit(rule, tp):
    t = torch.randn(16 * 8, 24)
    whole = Const(t)
    pieces = split_lazy(whole, rule, tp, ("x.weight",))
    for r, (piece, eager) in enumerate(zip(pieces, split(t, rule, tp))):
        p = piece.placement
        assert p.whole is whole and p.names == ("x.weight",) and p.shape == t.shape and p.part is None
        assert torch.equal(piece.load(), eager)
        assert torch.equal(blocks_of(piece), eager)  # the declared offsets are the data
        if rule in (Rule.COLUMN, Rule.VOCAB, Rule.QKV, Rule.ROW) and tp > 1:
            step = t.shape[p.dim] // tp
            assert p.blocks == ((r * step, step),) and p.offset[p.dim] == r * step
    if rule is Rule.GATED and tp > 1:  # two blocks: gate_r, then up_r
        assert [len(x.placement.blocks) for x in pieces] == [2] * tp
        assert pieces[1].placement.blocks == ((64 // tp, 64 // tp), (64 + 64 // tp, 64 // tp))


@pytest.mark.parametrize("heads,groups,tp", [(8, 2, 4), (8, 1, 2), (4, 4, 2), (8, 2, 8)])
def test_qkv_pieces_of_a_role_tensor_at_groups_below_tp(heads, groups, tp):
    """shard_role (the writers' split) of a fused QKV at TP above the query groups: each rank an even block
    of the grouped rows, declared under the layer's q, k, v names."""
    cfg = cfg_of(heads, groups, hidden_size=heads * 4)
    hd = cfg.head_dim
    q, k, v = torch.randn(heads * hd, 8), torch.randn(groups * hd, 8), torch.randn(groups * hd, 8)
    fused = Const(fuse_qkv(q, k, v, cfg))
    pieces = shard_role(fused, "qkv.weight", cfg, tp, layer=1)
    rows = (heads + 2 * groups) * hd // tp
    for r, piece in enumerate(pieces):
        assert piece.placement.names == ("layers.1.attn.q.weight", "layers.1.attn.k.weight", "layers.1.attn.v.weight")
        assert piece.placement.blocks == ((r * rows, rows),)
        assert torch.equal(piece.load(), blocks_of(piece))
    assert torch.equal(torch.cat([p.load() for p in pieces]), fused.load())


def test_assemble_declares_fused_parts_and_writers_take_the_whole_back():
    cfg = cfg_of(8, 2)
    hd, h = cfg.head_dim, cfg.hidden_size
    qkv = [Const(torch.randn((8 + 4) * hd // 2, h)) for _ in range(2)]  # two TP ranks' shards
    fc1 = [Const(torch.randn(48, h)) for _ in range(2)]
    out = assemble(cfg, {("qkv.weight", 0): qkv, ("fc1.weight", 0): fc1})
    parts = [out[f"layers.0.attn.{x}.weight"] for x in "qkv"] + [out[f"layers.0.mlp.{x}.weight"] for x in ("gate", "up")]
    for i, piece in enumerate(parts[:3]):
        p = piece.placement
        assert p.part == i and p.names == ("layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight")
        assert p.blocks == qkv_blocks(cfg, i) and len(p.blocks) == cfg.num_query_groups
        assert torch.equal(piece.load(), blocks_of(piece))
    for i, piece in enumerate(parts[3:]):
        assert piece.placement.part == i and piece.placement.blocks == ((i * 48, 48),)
        assert torch.equal(piece.load(), blocks_of(piece))
    # all parts of one whole, in order: the writer takes the fused tensor as it is
    assert layer_role_tensor(out, cfg, 0, "qkv.weight") is parts[0].placement.whole
    assert layer_role_tensor(out, cfg, 0, "fc1.weight") is parts[3].placement.whole
    # parts of different wholes (k from another checkpoint): fused again, and the same values
    other = assemble(cfg, {("qkv.weight", 0): [Const(torch.randn_like(x.load())) for x in qkv]})
    mixed = dict(out, **{"layers.0.attn.k.weight": other["layers.0.attn.k.weight"]})
    refused = layer_role_tensor(mixed, cfg, 0, "qkv.weight")
    assert refused is not parts[0].placement.whole
    assert torch.equal(refused.load(), fuse_qkv(parts[0].load(), other["layers.0.attn.k.weight"].load(),
                                                 parts[2].load(), cfg))
    swapped = dict(out, **{"layers.0.mlp.gate.weight": parts[4], "layers.0.mlp.up.weight": parts[3]})
    assert torch.equal(layer_role_tensor(swapped, cfg, 0, "fc1.weight").load(),
                       torch.cat([parts[4].load(), parts[3].load()]))


class Counted(LazyTensor):
    """A stored tensor that counts the bytes its loads read (a narrow reads only its rows)."""

    def __init__(self, t: torch.Tensor, log: list):
        self.t, self.log, self.shape, self.dtype = t, log, t.shape, t.dtype

    def load(self):
        self.log.append(self.t.numel() * self.t.element_size())
        return self.t.clone()

    def narrow(self, dim, start, length):
        return Counted(self.t.narrow(dim, start, length), self.log)


def _checkpoint(cfg, make) -> Checkpoint:
    from make_random_gpt import canonical_shape
    return Checkpoint(cfg, {n: make(n, canonical_shape(cfg, n)) for n in expected_names(cfg)},
                      SourceInfo(path="memory", format="test"))


@pytest.fixture
def scripts_on_path(monkeypatch):
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.mark.parametrize("fused", [False, True])
def test_a_gated_fc1_rank_slice_reads_only_its_rows(scripts_on_path, fused):
    """verify's rank view (slice_rank_shards) of a merged source: TP rank r's fc1 is [gate_r; up_r], read as
    two narrows (a quarter of gate and of up at TP 4), not the whole fc1 per rank; with gate and up parts of
    one stored fused fc1 (a TP1 Megatron source) it reads that tensor's two row ranges."""
    from ckptool.formats.megatron.ranks import slice_rank_shards
    cfg = cfg_of(8, 2)
    log: list = []
    g = torch.Generator().manual_seed(0)
    ckpt = _checkpoint(cfg, lambda n, shape: Counted(torch.randn(shape, generator=g), log))
    gate, up = ckpt.tensors["layers.0.mlp.gate.weight"], ckpt.tensors["layers.0.mlp.up.weight"]
    if fused:
        stored = Counted(torch.cat([gate.t, up.t]), log)
        parts = assemble(cfg, {("fc1.weight", 0): [stored]})
        ckpt.tensors.update({k: parts[k] for k in ("layers.0.mlp.gate.weight", "layers.0.mlp.up.weight")})
    fc1_bytes = 2 * gate.t.numel() * gate.t.element_size()
    for r in range(4):
        piece = slice_rank_shards(ckpt, Layout(tp=4), r, 0).tensors["layers.0.fc1.weight"]
        log.clear()
        with load_scope():
            got = piece.load()
        assert sum(log) == fc1_bytes // 4, log
        assert len(log) == 2  # two narrows: gate_r and up_r
        assert torch.equal(got, torch.cat([gate.t.chunk(4)[r], up.t.chunk(4)[r]]))


def test_verify_rank_view_of_a_torch_dist_source_is_the_writers_rank_file(scripts_on_path, tmp_path):
    """For QKV (GQA, TP 4 above 2 query groups), gated fc1, the vocabulary-padded embedding and output and the
    row-parallel tensors: what verify computes with on each rank of a torch_dist source (slice_rank_shards)
    is what write_megatron puts in that rank's file, bit for bit, and each piece's declared blocks are its data."""
    from ckptool.convert import write_layout
    from ckptool.formats.dcp import torch_dist as dist_format
    from ckptool.formats.megatron.checkpoint import write_megatron
    from ckptool.formats.megatron.ranks import read_rank_shards, slice_rank_shards
    cfg = cfg_of(8, 2)
    g = torch.Generator().manual_seed(1)
    src = _checkpoint(cfg, lambda n, shape: Const(torch.randn(shape, generator=g)))
    write_layout(src, tmp_path / "dist", Layout(tp=1), WriteOptions(format="torch_dist"), warn=lambda m: None)
    merged = dist_format.read(tmp_path / "dist")
    layout = Layout(tp=4, pp=2)
    write_megatron(merged, tmp_path / "tp4", layout, warn=lambda m: None)
    checked = set()
    for p in range(2):
        for t in range(4):
            mine = slice_rank_shards(merged, layout, t, p).tensors
            theirs = read_rank_shards(tmp_path / "tp4", t, p).tensors
            assert set(mine) == set(theirs)
            for name, piece in mine.items():
                got = piece.load()
                assert got.dtype == theirs[name].dtype and torch.equal(got, theirs[name].load()), (t, p, name)
                assert torch.equal(blocks_of(piece).to(got.dtype), got), name
                checked.add(name.split(".", 2)[-1] if name.startswith("layers.") else name)
    assert {"qkv.weight", "fc1.weight", "proj.weight", "fc2.weight", "embed.word", "output.weight"} <= checked
    # stored padded for TP 1 (104 rows); TP 4 ranks hold 32 rows each of the 128 the writer pads to
    assert merged.tensors["embed.word"].shape[0] == 104
    assert slice_rank_shards(merged, layout, 3, 0).tensors["embed.word"].shape[0] == 32


def test_megatron_writer_streams_by_declared_names():
    from ckptool.formats.megatron.checkpoint import HEAD_COPY_NAMES, _unit_of
    cfg = cfg_of()
    whole = Const(torch.zeros(4, 4))

    def unit(*names):
        return _unit_of(split_lazy(whole, Rule.COLUMN, 2, names)[0].placement, cfg.num_layers)

    assert unit("embed.word") == (-1, 0) and unit("embed.pos") == (-1, 0)
    assert unit("layers.1.attn.q.weight", "layers.1.attn.k.weight", "layers.1.attn.v.weight") == (1, 0)
    assert unit("layers.0.mlp.experts.5.gate.weight", "layers.0.mlp.experts.5.up.weight") == (0, 6)
    assert unit("layers.0.mlp.shared.up.weight") == (0, 0)
    assert unit("final_norm.weight") == unit("output.weight") == unit(*HEAD_COPY_NAMES) == (2, 0)
    assert _unit_of(Const(torch.zeros(1)).placement, cfg.num_layers) is None


def test_replica_divergence_is_returned_and_printed(scripts_on_path, tmp_path):
    """A TP2 Megatron source whose rank 1 holds a layer norm 0.25 away from rank 0's: merge's result returns
    the divergence as data (ConversionResult.replica_divergences) and the command prints the largest."""
    from click.testing import CliRunner
    import ckptool
    from ckptool.cli import main
    from ckptool.formats.megatron.checkpoint import write_megatron
    from ckptool.sharding import ReplicaPolicy, divergence_report
    g = torch.Generator().manual_seed(2)
    src = _checkpoint(cfg_of(8, 2), lambda n, shape: Const(torch.randn(shape, generator=g)))
    write_megatron(src, tmp_path / "tp2", Layout(tp=2), warn=lambda m: None)
    rank1 = next((tmp_path / "tp2").glob("*/mp_rank_01/model_optim_rng.pt"))
    state = torch.load(rank1, weights_only=False)  # our own file
    key = next(k for k in state["model"] if k.endswith("layers.1.self_attention.linear_qkv.layer_norm_weight")
               or k.endswith("layers.1.input_layernorm.weight"))
    state["model"][key] = state["model"][key] + 0.25
    torch.save(state, rank1)
    result = ckptool.merge(tmp_path / "tp2", tmp_path / "merged", warn=lambda m: None)
    assert list(result.replica_divergences) == ["layers.1.attn_norm.weight"]
    assert result.replica_divergences["layers.1.attn_norm.weight"] == pytest.approx(0.25, abs=1e-3)
    res = CliRunner().invoke(main, ["merge", str(tmp_path / "tp2"), str(tmp_path / "cli")])
    assert res.exit_code == 0, res.output
    assert "tensor-parallel replicas differ in 1 tensor(s); the largest divergence is 0.25 (max abs diff) in " \
           "layers.1.attn_norm.weight" in res.output
    same = ckptool.merge(tmp_path / "merged", tmp_path / "again", warn=lambda m: None)
    assert same.replica_divergences == {}
    policy = ReplicaPolicy("first")
    assert policy.report() is None
    policy.divergences.update(a=0.5, b=2.0)
    assert policy.report() == divergence_report({"a": 0.5, "b": 2.0}) and "is 2 (max abs diff) in b" in policy.report()


def test_writers_return_a_typed_summary(scripts_on_path, tmp_path):
    """write_megatron's WriteSummary: files, tensor records and bytes as written; fields and the format's own
    details read by name as the dict it replaced was; a team's parts combine into one."""
    import dataclasses
    from ckptool.formats.megatron.checkpoint import write_megatron
    from ckptool.summary import WriteSummary
    g = torch.Generator().manual_seed(3)
    src = _checkpoint(cfg_of(8, 2), lambda n, shape: Const(torch.randn(shape, generator=g)))
    s = write_megatron(src, tmp_path / "tp2", Layout(tp=2), warn=lambda m: None)
    assert isinstance(s, WriteSummary) and (s.format, s.files, s.optimizer, s.dialect) == ("torch", 2, None, "mcore")
    files = sorted((tmp_path / "tp2").glob("*/mp_rank_*/model_optim_rng.pt"))
    stored = [v for f in files for v in torch.load(f, weights_only=False)["model"].values() if isinstance(v, torch.Tensor)]
    assert s.tensors == len(stored) and s.bytes == sum(v.numel() * v.element_size() for v in stored)
    assert s["files"] == 2 and s["padded_vocab_size"] == 112 and s.get("optimizer") is None
    with pytest.raises(KeyError):
        s["architecture"]
    hf = WriteSummary("hf", 1, 10, tensors=3, file_names=["a"], details={"architecture": "X"})
    both = WriteSummary.combined([hf, dataclasses.replace(hf, bytes=5, tensors=0, file_names=["b"])])
    assert (both.files, both.bytes, both.tensors, both.file_names, both["architecture"]) == (2, 15, 3, ["a", "b"], "X")
