#!/usr/bin/env bash
# Time `ckptool verify` under torchrun on GPUs (NCCL) with a ~1B-parameter GPT written in the run.
#
#   OUT=/path/to/results bash scripts/gpu_verify.sh              # 1B model, needs 4 GPUs
#   VERIFY_SIZE=tiny NPROC_MAX=4 bash scripts/gpu_verify.sh      # CPU smoke test (gloo)
#
# Env: VERIFY_SIZE (1b|tiny, default 1b), VERIFY_DTYPE (bf16), VERIFY_BATCH (4),
#      VERIFY_SEQ (1024 for 1b, 16 for tiny), WORK (scratch dir, default a temp dir), OUT (results).
# Results: $OUT/results.txt, one line per run:
#   case=tp2pp2 nproc=4 rc=0 wall_seconds=.. forward_seconds=.. max_abs_error=.. mean_kl=.. top1_agreement=.. result=PASS
# plus $OUT/<case>.log with each run's full output.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off (the device machines' rule); harmless on CPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SIZE="${VERIFY_SIZE:-1b}"
DTYPE="${VERIFY_DTYPE:-bf16}"
BATCH="${VERIFY_BATCH:-4}"
if [ "$SIZE" = tiny ]; then SEQ="${VERIFY_SEQ:-16}"; else SEQ="${VERIFY_SEQ:-1024}"; fi
OUT="${OUT:-$PWD/gpu_verify_out}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
RESULTS="$OUT/results.txt"
: > "$RESULTS"

now() { python -c 'import time; print(time.time())'; }
field() { grep -m1 "^$1=" "$2" | cut -d= -f2- ; }

echo "size=$SIZE dtype=$DTYPE batch=$BATCH seq=$SEQ work=$WORK" | tee "$OUT/setup.txt"
t0=$(now)
python scripts/make_random_gpt.py "$WORK/ckpt" --size "$SIZE" --layouts 2x2,2x1 --dtype "$DTYPE" 2>&1 | tee -a "$OUT/setup.txt" || exit 1
echo "generate_wall_seconds=$(python -c "print(round($(now) - $t0, 2))")" | tee -a "$OUT/setup.txt"

run_case() {  # name nproc target [extra verify args...]
  local name=$1 nproc=$2 target=$3; shift 3
  local log="$OUT/$name.log" start rc wall
  start=$(now)
  python -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m ckptool verify "$target" \
      --dtype "$DTYPE" --batch "$BATCH" --seq-len "$SEQ" "$@" > "$log" 2>&1
  rc=$?
  wall=$(python -c "print(round($(now) - $start, 2))")
  echo "case=$name nproc=$nproc rc=$rc wall_seconds=$wall forward_seconds=$(field forward_seconds "$log")" \
       "max_abs_error=$(field max_abs_error "$log") mean_kl=$(field mean_kl "$log")" \
       "top1_agreement=$(field top1_agreement "$log") result=$(field result "$log")" | tee -a "$RESULTS"
}

# parallel forward vs the merged checkpoint run in one process (rank 0's GPU)
run_case tp2pp2 4 "$WORK/ckpt/tp2pp2"
run_case tp2pp1 2 "$WORK/ckpt/tp2pp1"
# the two layouts against each other: TP2 PP1 run in parallel, TP2 PP2 merged as the reference
run_case tp2pp1_vs_tp2pp2 2 "$WORK/ckpt/tp2pp1" --reference "$WORK/ckpt/tp2pp2"

if grep -q "rc=[^0]" "$RESULTS"; then echo "some runs failed: see $OUT/*.log"; exit 1; fi
echo "all runs passed; results in $RESULTS"
