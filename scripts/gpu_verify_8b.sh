#!/usr/bin/env bash
# Time `ckptool verify` of an 8B-class Llama (Llama-3-8B shapes: 32 layers, hidden 4096, 32 heads in 8
# query groups, FFN 14336, vocab 128256; random weights) on one GPU, and at TP2 / TP4 when the
# machine has the GPUs. The reference is transformers' LlamaForCausalLM on the `to-hf` output, run
# in the same launch on rank 0's GPU, so the wall time is target + reference + comparison.
#
#   OUT=/tmp/v8 WORK=/tmp/v8w bash scripts/gpu_verify_8b.sh            # TP1 on 1 GPU
#   LAYOUTS=1x1,2x1,4x1 OUT=... bash scripts/gpu_verify_8b.sh          # also TP2 (2 GPUs), TP4 (4 GPUs)
#   SIZE=llama-tiny VERIFY_SEQ=16 bash scripts/gpu_verify_8b.sh         # CPU smoke test (gloo)
#   REUSE=1 COLD=all LAUNCHER=ckptool CODE=/path/to/other/src TAG=old bash scripts/gpu_verify_8b.sh
#                                     # again on the same files: another source tree, every byte from the disk
#
# Env: SIZE (scripts/make_random_gpt.py size, default llama-8b), LAYOUTS (TPxPP list, default 1x1), DTYPES (compute dtypes, default "bf16 fp32"), VERIFY_BATCH (4),
#      VERIFY_SEQ (1024), SKIP (case names not to run, e.g. "llama-8b-tp1pp1-fp32"), WORK (scratch; ~16 GB per layout + 16 GB for the HF copy), OUT (results),
#      REUSE (1: WORK already holds the checkpoints: no generation, no to-hf), LAUNCHER (torchrun: python3 -m
#      torch.distributed.run, the default; ckptool: python3 -m ckptool.torchrun, which starts one node's ranks
#      without importing torch first), COLD (none, the default; libs: Python's and its packages' files dropped
#      from the page cache before each run, as on a fresh machine, the checkpoints staying cached; all: the
#      whole page cache dropped, so the target and the reference come from the disk too; needs root),
#      CODE (the ckptool source tree the runs import, default this checkout's src), TAG (added to case names).
#      CKPTOOL_PROFILE=1 adds each run's stage times (ckptool-profile line) to its log.
# Results: $OUT/results.txt, one line per run (wall, forward, errors, verdict); $OUT/<case>.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
export PYTHONPATH="${CODE:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off (the device machines' rule)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SIZE="${SIZE:-llama-8b}"
LAYOUTS="${LAYOUTS:-1x1}"
DTYPES="${DTYPES:-bf16 fp32}"
BATCH="${VERIFY_BATCH:-4}"
SEQ="${VERIFY_SEQ:-1024}"
OUT="${OUT:-$PWD/gpu_verify_8b_out}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
RESULTS="$OUT/results.txt"
[ -n "${REUSE:-}" ] || : > "$RESULTS"
LAUNCH="python3 -m torch.distributed.run --standalone" ENTRY="-m ckptool"
[ "${LAUNCHER:-torchrun}" = ckptool ] && LAUNCH="python3 -m ckptool.torchrun --standalone" ENTRY=""
TAG="${TAG:+-$TAG}"
settle() {  # the page cache as COLD says, before each timed run
  sync
  case "${COLD:-none}" in
    libs) python3 "$HERE/scripts/evict_libs.py";;
    all) echo 3 > /proc/sys/vm/drop_caches;;
  esac
}
now() { date +%s.%N; }
since() { python3 -c "print(round($(now) - $1, 2))"; }
field() { grep -m1 "^$1=" "$2" | cut -d= -f2- ; }

python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' | tee "$OUT/setup.txt"
GPUS=$(python3 -c 'import torch, os; print(torch.cuda.device_count() or os.cpu_count())')
DEVICE=$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
if [ -z "${REUSE:-}" ]; then
t0=$(now)
python3 scripts/make_random_gpt.py "$WORK" --size "$SIZE" --layouts "$LAYOUTS" --dtype bf16 --device "$DEVICE" \
    2>&1 | tee -a "$OUT/setup.txt" || exit 1
echo "generate_wall_seconds=$(since "$t0")" | tee -a "$OUT/setup.txt"
first="$WORK/tp${LAYOUTS%%x*}pp$(echo "${LAYOUTS%%,*}" | cut -dx -f2)"
t0=$(now)
python3 -m ckptool to-hf "$first" "$WORK/hf" > "$OUT/to-hf.log" 2>&1 || { tail -3 "$OUT/to-hf.log"; exit 1; }
echo "to_hf_wall_seconds=$(since "$t0")" | tee -a "$OUT/setup.txt"
fi

for spec in ${LAYOUTS//,/ }; do
  tp=${spec%x*}; pp=${spec#*x}; n=$((tp * pp))
  if [ "$n" -gt "$GPUS" ]; then echo "case=tp${tp}pp${pp} skipped: needs $n GPUs, $GPUS here" | tee -a "$RESULTS"; continue; fi
  for dt in $DTYPES; do
    name="$SIZE-tp${tp}pp${pp}-$dt$TAG"; log="$OUT/$name.log"
    case " ${SKIP:-} " in *" $name "*) continue;; esac
    settle; t0=$(now)
    $LAUNCH --nproc-per-node "$n" $ENTRY verify "$WORK/tp${tp}pp${pp}" \
        --reference "$WORK/hf" --dtype "$dt" --batch "$BATCH" --seq-len "$SEQ" > "$log" 2>&1
    rc=$?
    echo "case=$name gpus=$n rc=$rc wall_seconds=$(since "$t0") forward_seconds=$(field forward_seconds "$log")" \
         "max_abs_error=$(field max_abs_error "$log") mean_kl=$(field mean_kl "$log")" \
         "top1_agreement=$(field top1_agreement "$log") noise_floor=$(field noise_floor "$log")" \
         "tolerance=$(field tolerance "$log") result=$(field result "$log")" | tee -a "$RESULTS"
  done
done
grep -q "rc=[^0]" "$RESULTS" && { echo "some runs failed: see $OUT/*.log"; exit 1; }
echo "all runs passed; results in $RESULTS"
