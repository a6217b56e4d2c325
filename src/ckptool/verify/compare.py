"""Comparing a target forward with a reference: logits metrics, per-layer hidden states, a report.

Logits are compared on the true-vocabulary columns both sides have (padding rows may differ in
number and content). Hidden states are compared in order (embedding, layer 0, layer 1, ...); the
first one whose difference exceeds the tolerance, relative to the reference's scale, is where the
two models part ways: everything after it differs as a consequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

# Default tolerance on the max abs logits error per compute dtype (fp32 is reduction-order noise;
# 16-bit dtypes round every activation, so the same model run two ways differs far more).
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# In 16-bit compute the default tolerance is at least this many times the reference's own 16-bit
# error (its logits against the same reference computed in fp32): two runs that differ only in
# reduction order each sit about that far from the fp32 result, so up to ~2x apart; 3x leaves room
# for the tensor-parallel all-reduce's extra rounding.
NOISE_MARGIN = 3.0
# In fp32 the default logits bound is at least this fraction of the reference logits' largest |value|.
# fp32 rounding still adds up over depth and sequence (the rotary angles alone are rounded to about
# position x 2^-24 radians): on a random Llama-3-8B-shaped model (32 layers, hidden 4096, vocab 128256,
# 4 x 1024 tokens) on an H200 the exact TP1 conversion against transformers differed by 5.7e-4 in logits
# and 6e-5 of the hidden states' scale at the last layer (docs/verify.md), over the fixed 1e-4; a wrong
# tensor moves logits by a sizeable fraction of their scale, thousands of times more.
FP32_RELATIVE = 2e-4


@dataclass
class Report:
    columns: int
    max_abs_error: float
    mean_kl: float
    top1_agreement: float
    tolerance: float
    hidden: List[tuple] = field(default_factory=list)  # (name, max abs diff, relative diff)
    first_divergence: Optional[str] = None
    noise_floor: Optional[float] = None  # the reference's own 16-bit error, when measured
    hints: List[str] = field(default_factory=list)  # lines a FAIL adds about how the sides were read

    @property
    def ok(self) -> bool:
        return self.max_abs_error <= self.tolerance and self.first_divergence is None

    def failed_checks(self) -> List[str]:
        """Each check that failed, its value against its threshold: the logits' max abs error, and the
        per-layer check (relative diff of the first diverging hidden state), which fails on its own when
        a layer parts ways by more than its bound while the logits stay within the tolerance."""
        out = []
        if self.max_abs_error > self.tolerance:
            out.append(f"logits max_abs_error {self.max_abs_error:.6g} > tolerance {self.tolerance:.3g}")
        layer = next(((n, rel) for n, _, rel in self.hidden if n == self.first_divergence), None)
        if layer is not None:
            within = "" if out else (f" (the logits are within the tolerance: max_abs_error "
                                     f"{self.max_abs_error:.6g} <= {self.tolerance:.3g})")
            out.append(f"per-layer check: {layer[0]} hidden state relative diff {layer[1]:.6g} > "
                       f"{relative_tolerance(self.tolerance):.3g}{within}")
        return out

    def lines(self, where: Optional[Dict[str, str]] = None) -> List[str]:
        out = [f"compared {self.columns} vocabulary columns",
               f"max_abs_error={self.max_abs_error:.6g}",
               f"mean_kl={self.mean_kl:.6g}",
               f"top1_agreement={self.top1_agreement:.6g}",
               f"tolerance={self.tolerance:.3g}"]
        if self.noise_floor is not None:
            out.append(f"noise_floor={self.noise_floor:.6g}")
        for name, diff, rel in self.hidden:
            out.append(f"  {name:<12} max abs diff {diff:.3g} (relative {rel:.3g})")
        if self.first_divergence:
            extra = f" [{where[self.first_divergence]}]" if where and self.first_divergence in where else ""
            out.append(f"first_divergence={self.first_divergence}{extra}")
        if not self.ok:
            out += [f"failed_check={check}" for check in self.failed_checks()] + self.hints
        out.append("result=PASS" if self.ok else "result=FAIL")
        return out


# Logits are compared in pieces of rows of about this many values (float64 on the compare device: 512 MiB a
# piece): an 8B Llama's 4 x 1024 x 128256 logits are 4 GiB in float64, and the two softmaxes as much again
# each, which whole would take more than the target's own weights on the host.
PIECE_VALUES = 1 << 26


def compare(target_logits: torch.Tensor, ref_logits: torch.Tensor, columns: int, tolerance: float,
            target_hidden: Optional[Dict[str, torch.Tensor]] = None,
            ref_hidden: Optional[Dict[str, torch.Tensor]] = None, noise_floor: Optional[float] = None,
            device="cpu", relative: Optional[float] = None) -> Report:
    """relative: the per-layer bound on hidden states relative to their scale (default
    relative_tolerance(tolerance)); device: where the float64 arithmetic runs (the GPU verify ran on)."""
    max_abs, kl, top1 = _logit_metrics(target_logits, ref_logits, columns, device)
    report = Report(columns, max_abs, kl, top1, tolerance, noise_floor=noise_floor)
    bound = relative_tolerance(tolerance) if relative is None else relative
    if target_hidden and ref_hidden:
        for name, th in target_hidden.items():
            rh = ref_hidden.get(name)
            if rh is None:
                continue
            rh = rh.to(device, torch.float64)
            diff = (th.to(device, torch.float64) - rh).abs().max().item()
            rel = diff / max(rh.abs().max().item(), 1e-6)
            report.hidden.append((name, diff, rel))
            if report.first_divergence is None and rel > bound:
                report.first_divergence = name
    if report.first_divergence is None and max_abs > tolerance:
        unseen = [n for n in (target_hidden or {}) if ref_hidden and n not in ref_hidden]
        # e.g. transformers' last hidden state is taken after the final norm, so not comparable
        report.first_divergence = (f"{unseen[0]} or the output layer (the reference has no hidden state "
                                   f"for {unseen[0]})" if unseen else "output layer (logits)")
    return report


def _row_pieces(tensors, columns: int, device):
    """For each few rows of [..., :columns]: the tensors' pieces, in float64 on device."""
    rows = [t[..., :columns].reshape(-1, columns) for t in tensors]
    step = max(1, PIECE_VALUES // columns)
    for i in range(0, rows[0].shape[0], step):
        yield [t[i:i + step].to(device, torch.float64) for t in rows]


def _logit_metrics(target: torch.Tensor, ref: torch.Tensor, columns: int, device) -> tuple:
    """(max abs error, mean KL(ref || target) per token, top-1 agreement) over the first `columns` columns."""
    max_abs, kl, top1, rows = 0.0, 0.0, 0, 0
    for t, r in _row_pieces((target, ref), columns, device):
        max_abs = max(max_abs, (t - r).abs().max().item())
        log_p, log_q = torch.log_softmax(r, -1), torch.log_softmax(t, -1)
        kl += (log_p.exp() * (log_p - log_q)).sum().item()
        top1 += (t.argmax(-1) == r.argmax(-1)).sum().item()
        rows += t.shape[0]
    return max_abs, kl / max(rows, 1), top1 / max(rows, 1)


def max_abs_error(a: torch.Tensor, b: torch.Tensor, columns: int, device="cpu") -> float:
    return max((x - y).abs().max().item() for x, y in _row_pieces((a, b), columns, device))


def max_abs(a: torch.Tensor, columns: int, device="cpu") -> float:
    """The largest |value| of a's first `columns` columns (the logits' scale)."""
    return max(x.abs().max().item() for x, in _row_pieces((a,), columns, device))


def relative_tolerance(tolerance: float) -> float:
    # Hidden states are judged relative to their own scale; logits scale is O(1-10) too, so the
    # logits tolerance serves as a relative bound, never tighter than float32 noise.
    return max(tolerance, 1e-5)


def true_columns(target_cols: int, target_vocab: Optional[int], ref_cols: int,
                 ref_vocab: Optional[int]) -> int:
    """The vocabulary columns both sides share: padding may differ, so cut to the true size."""
    sizes = [target_cols, ref_cols] + [v for v in (target_vocab, ref_vocab) if v]
    return min(sizes)
