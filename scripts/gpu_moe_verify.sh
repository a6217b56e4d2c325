#!/usr/bin/env bash
# `ckptool verify` of MoE checkpoints on GPUs (NCCL), against transformers' own forward of the model
# they came from: a random Mixtral (16 experts, hidden 1024, 8 layers, top-2) and a Qwen3-MoE of the
# same size, built by transformers in the run (scripts/make_hf_moe.py), brought in with from-hf at
# expert-parallel layouts, verified under torchrun with each rank holding only its experts, then
# converted back with to-hf and compared tensor by tensor with the source.
#
#   OUT=/path/to/results bash scripts/gpu_moe_verify.sh                  # 2 GPUs (EP2, TP2, ETP1 layouts)
#   NPROC=4 OUT=/path/to/results bash scripts/gpu_moe_verify.sh          # 4 GPUs: also TP2 EP2, EP4, PP2 EP2, VPP2 EP2
#   MOE_SIZE=tiny NPROC=2 bash scripts/gpu_moe_verify.sh                  # CPU smoke test (gloo)
#
#   MOE_FAMILIES=deepseek_v3 OUT=... bash scripts/gpu_moe_verify.sh     # DeepSeek-V3: MLA, YaRN, group routing
#
# Env: MOE_FAMILIES (default "mixtral qwen3_moe"; deepseek_v3 too), MOE_SIZE (16x1024), NPROC (GPUs to use, default 2),
#      VERIFY_BATCH (4), VERIFY_SEQ (512; 16 for tiny), WORK (scratch), OUT (results).
# Results: $OUT/results.txt, one line per run (case, ranks, rc, wall, forward, errors, result) and
#          $OUT/<case>.log with each run's output.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FAMILIES="${MOE_FAMILIES:-mixtral qwen3_moe}"
SIZE="${MOE_SIZE:-16x1024}"
NPROC="${NPROC:-2}"
BATCH="${VERIFY_BATCH:-4}"
case "$SIZE" in tiny) SEQ="${VERIFY_SEQ:-16}";; *) SEQ="${VERIFY_SEQ:-512}";; esac
OUT="${OUT:-$PWD/gpu_moe_out}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
RESULTS="$OUT/results.txt"
: > "$RESULTS"
now() { python -c 'import time; print(time.time())'; }
field() { grep -m1 "^$1=" "$2" | cut -d= -f2- ; }
timed() {  # label command...: run, log, record wall seconds
  local label=$1 t0 rc; shift
  t0=$(now); "$@" > "$OUT/$label.log" 2>&1; rc=$?
  echo "step=$label rc=$rc wall_seconds=$(python -c "print(round($(now) - $t0, 2))")" | tee -a "$OUT/setup.txt"
  return $rc
}

python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' \
      | tee "$OUT/setup.txt"
echo "families=$FAMILIES size=$SIZE nproc=$NPROC batch=$BATCH seq=$SEQ" | tee -a "$OUT/setup.txt"

run_case() {  # name nproc target [extra verify args...]
  local name=$1 nproc=$2 target=$3 log="$OUT/$1.log" t0 rc; shift 3
  t0=$(now)
  python -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m ckptool verify "$target" \
      --batch "$BATCH" --seq-len "$SEQ" "$@" > "$log" 2>&1
  rc=$?
  echo "case=$name nproc=$nproc rc=$rc wall_seconds=$(python -c "print(round($(now) - $t0, 2))")" \
       "forward_seconds=$(field forward_seconds "$log") max_abs_error=$(field max_abs_error "$log")" \
       "mean_kl=$(field mean_kl "$log") top1_agreement=$(field top1_agreement "$log")" \
       "result=$(field result "$log")" | tee -a "$RESULTS"
}

for fam in $FAMILIES; do
  hf="$WORK/$fam-hf"
  python scripts/make_hf_moe.py "$hf" --family "$fam" --size "$SIZE" 2>/dev/null | tee -a "$OUT/setup.txt" || exit 1
  # EP over all GPUs (each rank holds experts/NPROC experts), and TP x EP where the GPUs allow
  timed "$fam-from-hf-ep$NPROC" python -m ckptool from-hf "$hf" "$WORK/$fam-ep" --ep "$NPROC" || exit 1
  run_case "$fam-ep$NPROC-bf16" "$NPROC" "$WORK/$fam-ep" --reference "$hf" --dtype bf16
  run_case "$fam-ep$NPROC-fp32" "$NPROC" "$WORK/$fam-ep" --reference "$hf" --dtype fp32
  # other layouts: name, processes, from-hf flags (expert TP 1 at TP2 EP2 runs on the 2 files
  # Megatron-LM writes: PP x lcm(TP, ETP x EP) processes)
  for c in "tp2ep1 2 --tp 2 --ep 1" "tp2ep2etp1 2 --tp 2 --ep 2 --etp 1" "tp2ep2 4 --tp 2 --ep 2" \
           "tp1ep4 4 --tp 1 --ep 4" "pp2ep2 4 --tp 1 --pp 2 --ep 2" "pp2vpp2ep2 4 --tp 1 --pp 2 --vpp 2 --ep 2"; do
    set -- $c; name=$1 n=$2; shift 2
    [ "$n" -le "$NPROC" ] || continue
    timed "$fam-from-hf-$name" python -m ckptool from-hf "$hf" "$WORK/$fam-$name" "$@" || exit 1
    run_case "$fam-$name-fp32" "$n" "$WORK/$fam-$name" --reference "$hf" --dtype fp32
  done
  # back to HF: every tensor equal to the source's
  timed "$fam-to-hf" python -m ckptool to-hf "$WORK/$fam-ep" "$WORK/$fam-back" || exit 1
  python - "$hf" "$WORK/$fam-back" <<'PY' | tee -a "$RESULTS"
import sys, torch
from safetensors.torch import load_file
from pathlib import Path
def tensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
print(f"case=round-trip-{Path(sys.argv[1]).name} tensors={len(a)} bit_exact={same}")
PY
  rm -rf "${WORK:?}/$fam-"*
done
if grep -q "rc=[^0]\|bit_exact=False" "$RESULTS"; then echo "some runs failed: see $OUT/*.log"; exit 1; fi
echo "all runs passed; results in $RESULTS"
