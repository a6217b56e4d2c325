"""The layout options a user gives (--tp, --pp, --vpp, --ep, --etp, --dp, --pp-layers), checked in one
place for the CLI and the API alike, and for reshard completed from the source's layout.

A size below 1 would otherwise reach the writers as a division by zero or an empty checkpoint, so every
one is refused here, by name, before the source is opened and before anything is written."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from .config import Layout, parse_stage_layers
from .errors import CkptError

# option (API name; the CLI's is --name) -> what its number counts. Every one is at least 1.
SIZE_OPTIONS = {
    "tp": "tensor-parallel size",
    "pp": "pipeline-parallel size",
    "vpp": "virtual pipeline size (chunks per stage; 1: none)",
    "ep": "expert-parallel size",
    "etp": "expert tensor-parallel size",
    "dp": "data-parallel size",
}


def check_sizes(**sizes: Optional[int]) -> None:
    """CkptError naming the first option (SIZE_OPTIONS) that is not a whole number of at least 1; None
    means not given."""
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise CkptError(f"--{name} {value!r}: the {SIZE_OPTIONS[name]} is a whole number",
                            f"give --{name} 1 or more")
        if value < 1:
            raise CkptError(f"--{name} {value}: the {SIZE_OPTIONS[name]} is at least 1", f"give --{name} 1 or more")


def stage_layers(value: Union[str, Sequence[int], None]) -> Optional[Tuple[int, ...]]:
    """--pp-layers ("3,5" or [3, 5]) as layer counts, each at least 1: Megatron has no empty stage."""
    if value is None or isinstance(value, str):
        stages = parse_stage_layers(value)
    else:
        stages = [int(x) for x in value]
    if stages is None:
        return None
    if any(n < 1 for n in stages):
        given = ",".join(map(str, stages))
        raise CkptError(f"--pp-layers {given}: every pipeline stage needs at least 1 layer",
                        "give each stage 1 layer or more")
    return tuple(stages)


@dataclass(frozen=True)
class LayoutRequest:
    """The layout options as given (None: left out), each checked on creation (LayoutRequest.of)."""
    tp: Optional[int] = None
    pp: Optional[int] = None
    vpp: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    pp_layers: Optional[Tuple[int, ...]] = None

    @classmethod
    def of(cls, tp=None, pp=None, vpp=None, ep=None, etp=None, pp_layers=None) -> "LayoutRequest":
        check_sizes(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
        return cls(tp, pp, vpp, ep, etp, stage_layers(pp_layers))

    def as_given(self) -> Layout:
        """The layout with Megatron's defaults for what was left out (from-hf, which has no source layout):
        TP, PP, EP 1, no virtual pipeline, an even split, expert TP = TP."""
        return Layout(tp=self.tp or 1, pp=self.pp or 1, vpp=_virtual(self.vpp), ep=self.ep or 1, etp=self.etp,
                      stage_layers=_listed(self.pp_layers))

    def completed(self, source: Layout, num_layers: int) -> Tuple[Layout, str]:
        """reshard's target: each option left out takes the source's value (PP: the number of --pp-layers
        stages when those are given), the virtual pipeline, expert TP and uneven split only where they still
        fit the rest. Returns the layout and a note saying what was kept from the source and what not."""
        notes = _Notes()
        tp = self.tp if self.tp is not None else notes.kept("TP", source.tp)
        pp = self.pp if self.pp is not None else (
            len(self.pp_layers) if self.pp_layers else notes.kept("PP", source.pp))
        ep = self.ep if self.ep is not None else notes.kept("EP", source.ep, shown=source.ep > 1)
        etp = self.etp if self.etp is not None else notes.kept_if(
            "ETP", source.etp, f"it does not divide TP{tp}" if source.etp and tp % source.etp else None)
        vpp = _virtual(self.vpp) if self.vpp is not None else notes.kept_if(
            "VPP", source.vpp, _vpp_misfit(source.vpp, pp, num_layers, self.pp_layers))
        stages = self.pp_layers or notes.kept_if(
            "pipeline split", source.stage_layers, _split_misfit(source.stage_layers, pp, vpp),
            spelled=f"pipeline split {','.join(map(str, source.stage_layers or ()))}")
        return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, stage_layers=_listed(stages)), notes.text()


class _Notes:
    """What completed() kept from the source and what it could not keep, as one note."""

    def __init__(self):
        self.kept_names: List[str] = []
        self.dropped: List[str] = []

    def kept(self, name: str, value, shown: bool = True):
        if shown:
            self.kept_names.append(name)
        return value

    def kept_if(self, name: str, value, misfit: Optional[str], spelled: str = ""):
        """The source's value where it fits (None where the source has none), else None and why not
        (spelled: how the note names the value; default name and value, as VPP2)."""
        if value is None:
            return None
        if misfit:
            self.dropped.append(f"the source's {spelled or f'{name}{value}'} not kept: {misfit}")
            return None
        return self.kept(name, value)

    def text(self) -> str:
        parts = ([f"{', '.join(self.kept_names)} kept from the source"] if self.kept_names else []) + self.dropped
        return "; ".join(parts) or "as given"


def _vpp_misfit(vpp: Optional[int], pp: int, num_layers: int, pp_layers) -> Optional[str]:
    if vpp is None:
        return None
    if pp_layers:
        return "--pp-layers gives the split"
    if pp < 2:
        return f"PP{pp} has no virtual pipeline"
    if num_layers % (pp * vpp):
        return f"{num_layers} layers do not split into PP{pp} x VPP{vpp}"
    return None


def _split_misfit(stages: Optional[Sequence[int]], pp: int, vpp: Optional[int]) -> Optional[str]:
    if stages is None:
        return None
    if vpp:
        return "VPP splits evenly"
    if len(stages) != pp:
        return f"it has {len(stages)} stages, not {pp}"
    return None


def _virtual(vpp: Optional[int]) -> Optional[int]:
    return vpp if vpp is not None and vpp >= 2 else None  # 1: no virtual pipeline, as Megatron's None


def _listed(stages: Optional[Tuple[int, ...]]) -> Optional[list]:
    return list(stages) if stages else None
