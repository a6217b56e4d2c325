"""The layout options (--tp, --pp, --vpp, --ep, --etp, --dp, --pp-layers) of reshard, from-hf, merge and verify:
a size below 1 or an empty pipeline stage is refused in one line naming the option, exit 2, nothing written,
through the CLI and the API alike (issue 28); reshard keeps the source's value of each option left out and
says so."""
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptool
from ckptool.cli import main
from ckptool.config import Layout
from ckptool.errors import CkptError
from ckptool.formats.megatron.checkpoint import read_megatron

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"  # TP2 PP2, 4 layers
HF = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "hf"

# (option, value, what the one line says): every size below 1, and a pipeline stage without a layer
BAD = [("--tp", "0", "--tp 0: the tensor-parallel size is at least 1"),
       ("--pp", "0", "--pp 0: the pipeline-parallel size is at least 1"),
       ("--pp", "-1", "--pp -1: the pipeline-parallel size is at least 1"),
       ("--vpp", "0", "--vpp 0: the virtual pipeline size"),
       ("--vpp", "-1", "--vpp -1: the virtual pipeline size"),
       ("--ep", "0", "--ep 0: the expert-parallel size is at least 1"),
       ("--etp", "0", "--etp 0: the expert tensor-parallel size is at least 1"),
       ("--pp-layers", "4,0", "--pp-layers 4,0: every pipeline stage needs at least 1 layer")]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused_in_one_line(tmp_path: Path, command: str, src: Path, *options, words: str) -> None:
    """`ckptool COMMAND SRC OUT OPTIONS`: exit 2, one `error:` line with words in it, and nothing at all beside
    where the output would go."""
    out = tmp_path / "empty" / "out"
    out.parent.mkdir()
    result = cli(command, src, out, *options)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []  # no partial or temporary folder either


@pytest.mark.parametrize("option, value, words", BAD + [("--dp", "0", "--dp 0: the data-parallel size is at least 1")])
def test_reshard_refuses_a_size_below_one_by_name(tmp_path, option, value, words):
    refused_in_one_line(tmp_path, "reshard", SRC, option, value, words=words)


def test_reshard_refuses_an_empty_stage_beside_the_right_stage_count(tmp_path):
    refused_in_one_line(tmp_path, "reshard", SRC, "--tp", 2, "--pp", 2, "--pp-layers", "4,0",
                        words="--pp-layers 4,0: every pipeline stage needs at least 1 layer")


@pytest.mark.parametrize("option, value, words", BAD)
def test_from_hf_refuses_a_size_below_one_by_name(tmp_path, option, value, words):
    refused_in_one_line(tmp_path, "from-hf", HF, option, value, words=words)


def test_merge_and_verify_refuse_their_sizes_by_name(tmp_path):
    refused_in_one_line(tmp_path, "merge", SRC, "--distributed-optimizer", "--dp", 0,
                        words="--dp 0: the data-parallel size is at least 1")
    r = cli("verify", SRC, "--tp", 0)
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: --tp 0: the tensor-parallel size is at least 1 (give --tp 1 or more)"], r.output


@pytest.mark.parametrize("call, kw, words", [
    (ckptool.reshard, dict(pp=0), "--pp 0: the pipeline-parallel size is at least 1"),
    (ckptool.reshard, dict(tp=2, vpp=-1), "--vpp -1: the virtual pipeline size"),
    (ckptool.reshard, dict(tp=2, pp=2, pp_layers=[4, 0]), "--pp-layers 4,0: every pipeline stage"),
    (ckptool.reshard, dict(tp=2, ep=0), "--ep 0: the expert-parallel size is at least 1"),
    (ckptool.reshard, dict(tp="2"), "--tp '2': the tensor-parallel size is a whole number"),
    (ckptool.from_hf, dict(pp=-1), "--pp -1: the pipeline-parallel size is at least 1"),
    (ckptool.from_hf, dict(etp=0), "--etp 0: the expert tensor-parallel size is at least 1"),
    (ckptool.merge, dict(distributed_optimizer=True, dp=0), "--dp 0: the data-parallel size is at least 1")])
def test_the_api_raises_the_same_error(tmp_path, call, kw, words):
    src = HF if call is ckptool.from_hf else SRC
    with pytest.raises(CkptError, match=words.replace("(", r"\(")) as e:
        call(src, tmp_path / "out", **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_tp_alone_keeps_the_sources_pipeline_and_says_so(tmp_path):
    r = cli("reshard", SRC, tmp_path / "tp4", "--tp", 4)
    assert r.exit_code == 0, r.output
    assert read_megatron(tmp_path / "tp4").source.layout.describe() == "TP4 PP2"
    assert "  layout: TP4 PP2 (PP kept from the source)" in r.stdout.splitlines()


def test_pp_alone_keeps_the_sources_tensor_parallel_size(tmp_path):
    r = cli("reshard", SRC, tmp_path / "pp1", "--pp", 1)
    assert r.exit_code == 0, r.output
    assert read_megatron(tmp_path / "pp1").source.layout.describe() == "TP2 PP1"
    assert "  layout: TP2 PP1 (TP kept from the source)" in r.stdout.splitlines()


def test_no_layout_option_rewrites_at_the_sources_layout(tmp_path):
    r = cli("reshard", SRC, tmp_path / "same")
    assert r.exit_code == 0, r.output
    assert read_megatron(tmp_path / "same").source.layout == read_megatron(SRC).source.layout
    assert "  layout: TP2 PP2 (TP, PP kept from the source)" in r.stdout.splitlines()


def test_the_api_keeps_what_is_left_out_as_the_cli_does(tmp_path):
    result = ckptool.reshard(SRC, tmp_path / "tp4", tp=4)
    assert result.layout.describe() == "TP4 PP2" and result.layout_note == "PP kept from the source"
    assert read_megatron(tmp_path / "tp4").source.layout.describe() == "TP4 PP2"
    both = ckptool.reshard(SRC, tmp_path / "tp1pp4", tp=1, pp=4)
    assert both.layout.describe() == "TP1 PP4" and both.layout_note == "as given"


def test_the_sources_virtual_pipeline_split_and_expert_tp_are_kept_only_where_they_fit():
    """completed() on the source layouts a reshard meets (12 or 8 layers): each kept where the rest still
    allows it, else dropped with the reason in the note."""
    from ckptool.layout_request import LayoutRequest  # here: the other tests run (and fail) on a tree without it
    vpp2 = Layout(tp=2, pp=2, vpp=2)
    assert LayoutRequest.of(tp=1).completed(vpp2, 12) == (Layout(tp=1, pp=2, vpp=2), "PP, VPP kept from the source")
    assert LayoutRequest.of(pp=4).completed(vpp2, 12) == (
        Layout(tp=2, pp=4),
        "TP kept from the source; the source's VPP2 not kept: 12 layers do not split into PP4 x VPP2")
    assert LayoutRequest.of(pp=4).completed(vpp2, 8)[0] == Layout(tp=2, pp=4, vpp=2)  # 8 layers do
    assert LayoutRequest.of(pp=1).completed(vpp2, 12)[0] == Layout(tp=2, pp=1)
    assert LayoutRequest.of(vpp=1).completed(vpp2, 12)[0] == Layout(tp=2, pp=2)  # --vpp 1: no virtual pipeline
    uneven = Layout(tp=1, pp=2, stage_layers=[3, 5])
    assert LayoutRequest.of(tp=2).completed(uneven, 8) == (
        Layout(tp=2, pp=2, stage_layers=[3, 5]), "PP, pipeline split kept from the source")
    assert LayoutRequest.of(pp=4).completed(uneven, 8) == (
        Layout(tp=1, pp=4), "TP kept from the source; the source's pipeline split 3,5 not kept: it has 2 stages, not 4")
    assert LayoutRequest.of(pp_layers="2,2,4").completed(uneven, 8)[0] == Layout(tp=1, pp=3, stage_layers=[2, 2, 4])
    experts = Layout(tp=2, ep=2, etp=1)
    assert LayoutRequest.of(tp=4).completed(experts, 8) == (
        Layout(tp=4, ep=2, etp=1), "PP, EP, ETP kept from the source")
    assert LayoutRequest.of(tp=1, etp=None).completed(Layout(tp=4, ep=2, etp=2), 8)[1] == (
        "PP, EP kept from the source; the source's ETP2 not kept: it does not divide TP1")
