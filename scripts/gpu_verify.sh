#!/usr/bin/env bash
# Time `ckptool verify` under torchrun on GPUs (NCCL) with ~1B-parameter GPTs written in the run:
# a GPT-2 style and a Llama style (GQA, SwiGLU, RoPE, RMSNorm) model, each at TP2 PP2 (4 GPUs) and
# TP2 PP1 (2 GPUs), in bf16 and fp32 compute, rewritten as torch_dist, and the Llama one converted
# with to-hf and checked against transformers.
#
#   OUT=/path/to/results bash scripts/gpu_verify.sh                        # needs 4 GPUs
#   VERIFY_MODELS="tiny llama-tiny" bash scripts/gpu_verify.sh             # CPU smoke test (gloo)
#
# Env: VERIFY_MODELS (sizes of scripts/make_random_gpt.py, default "1b llama-1b"), VERIFY_DTYPE (bf16),
#      VERIFY_BATCH (4), VERIFY_SEQ (1024; 16 for tiny models), WORK (scratch dir, default a temp
#      dir), OUT (results).
# Results: $OUT/results.txt, one line per run:
#   case=tp2pp2 nproc=4 rc=0 wall_seconds=.. forward_seconds=.. max_abs_error=.. mean_kl=.. top1_agreement=.. result=PASS
# plus $OUT/<case>.log with each run's full output.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off (the device machines' rule); harmless on CPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODELS="${VERIFY_MODELS:-1b llama-1b}"
DTYPE="${VERIFY_DTYPE:-bf16}"
BATCH="${VERIFY_BATCH:-4}"
case "$MODELS" in *tiny*) SEQ="${VERIFY_SEQ:-16}";; *) SEQ="${VERIFY_SEQ:-1024}";; esac
OUT="${OUT:-$PWD/gpu_verify_out}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
RESULTS="$OUT/results.txt"
: > "$RESULTS"

now() { python -c 'import time; print(time.time())'; }
field() { grep -m1 "^$1=" "$2" | cut -d= -f2- ; }

echo "models=$MODELS dtype=$DTYPE batch=$BATCH seq=$SEQ work=$WORK" | tee "$OUT/setup.txt"
python -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' | tee -a "$OUT/setup.txt"

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

for model in $MODELS; do
  t0=$(now)
  python scripts/make_random_gpt.py "$WORK/$model" --size "$model" --layouts 2x2,2x1 --dtype "$DTYPE" 2>&1 \
      | tee -a "$OUT/setup.txt" || exit 1
  echo "model=$model generate_wall_seconds=$(python -c "print(round($(now) - $t0, 2))")" | tee -a "$OUT/setup.txt"
  # parallel forward vs the merged checkpoint run in one process (rank 0's GPU)
  run_case "$model-tp2pp2" 4 "$WORK/$model/tp2pp2"
  run_case "$model-tp2pp2-fp32" 4 "$WORK/$model/tp2pp2" --dtype fp32  # same weights computed in fp32
  run_case "$model-tp2pp1" 2 "$WORK/$model/tp2pp1"
  # the two layouts against each other: TP2 PP1 run in parallel, TP2 PP2 merged as the reference
  run_case "$model-tp2pp1-vs-tp2pp2" 2 "$WORK/$model/tp2pp1" --reference "$WORK/$model/tp2pp2"
  # torch_dist: the TP2 PP2 checkpoint rewritten with --format torch_dist, each rank reading its slices
  python -m ckptool reshard "$WORK/$model/tp2pp2" "$WORK/$model/dist" --tp 2 --pp 2 --format torch_dist \
      > "$OUT/$model-to-dist.log" 2>&1 || exit 1
  run_case "$model-torch_dist-tp2pp2" 4 "$WORK/$model/dist" --tp 2 --pp 2 --reference "$WORK/$model/tp2pp2"
  case "$model" in llama*)  # to-hf, then transformers as the reference of the TP2 PP2 run
    t0=$(now)
    python -m ckptool to-hf "$WORK/$model/tp2pp2" "$WORK/$model/hf" > "$OUT/$model-to-hf.log" 2>&1 || exit 1
    echo "model=$model to_hf_wall_seconds=$(python -c "print(round($(now) - $t0, 2))")" | tee -a "$OUT/setup.txt"
    run_case "$model-tp2pp2-vs-transformers" 4 "$WORK/$model/tp2pp2" --reference "$WORK/$model/hf";;
  esac
  rm -rf "${WORK:?}/$model"
done

if grep -q "rc=[^0]" "$RESULTS"; then echo "some runs failed: see $OUT/*.log"; exit 1; fi
echo "all runs passed; results in $RESULTS"
