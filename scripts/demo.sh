#!/usr/bin/env bash
# The main job on the embedded default: install ckptool (pinned CPU torch first), inspect the
# small TP2 PP2 fixture, merge it to one rank, reshard it to TP4, inspect the result, and prove the
# TP4 result computes what the source computes (the parallel forward under torchrun, 4 processes);
# then reshard a checkpoint Megatron-LM wrote, carrying its optimizer state (masters, Adam moments).
# On an externally managed python3 (PEP 668) it installs into a virtual environment (scripts/_python.sh).
# Outputs go to a new directory under $TMPDIR (default /tmp), removed at the end, on failure and on
# interruption; KEEP=1 keeps it and says where.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
install_ckptool ''
SRC=fixtures/gpt2_mcore_tp2pp2/checkpoint
OUT=$(mktemp -d "${TMPDIR:-/tmp}/ckptool-demo.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
    trap 'echo; echo "outputs kept in $OUT (KEEP=1)"' EXIT
else
    trap 'rm -rf "$OUT"' EXIT
fi
trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP  # through the EXIT trap
echo "== inspect $SRC"
ckptool inspect "$SRC" --no-tensors
echo; echo "== merge $SRC -> $OUT/merged (TP1 PP1)"
ckptool merge "$SRC" "$OUT/merged"
echo; echo "== reshard $OUT/merged -> $OUT/tp4 (TP4 PP1)"
ckptool reshard "$OUT/merged" "$OUT/tp4" --tp 4 --pp 1
echo; echo "== inspect $OUT/tp4"
ckptool inspect "$OUT/tp4" --no-tensors
echo; echo "== verify $OUT/tp4 (TP4 forward under torchrun, gloo) against $SRC"
# TMPDIR: torchrun's own scratch (its log directory, which it leaves) goes with the outputs
OMP_NUM_THREADS=1 TMPDIR="$OUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 \
    -m ckptool verify "$OUT/tp4" --reference "$SRC" 2>&1 | grep -v "^\*\|OMP_NUM_THREADS"
REAL=fixtures/real/mlm_mcore_gpt2_torch_tp2pp2/checkpoint
echo; echo "== reshard $REAL (written by Megatron-LM, with its optimizer state) -> $OUT/mlm_tp1 (TP1 PP1)"
ckptool reshard "$REAL" "$OUT/mlm_tp1" --tp 1 --pp 1
ckptool inspect "$OUT/mlm_tp1" --no-tensors | grep -E "^(layout|optimizer)"
