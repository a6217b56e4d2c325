#!/usr/bin/env bash
# `ckptool verify` under torchrun on GPUs (NCCL) with a larger MoE model: a Mixtral built by transformers
# in the run (16 experts, top-2, hidden 1024, 4 layers; weights moved off their init), brought to
# Megatron with from-hf at expert-parallel layouts, and each layout's parallel forward compared with
# transformers' MixtralForCausalLM on the same tokens (the HF directory is the reference).
#
#   OUT=/path/to/results bash scripts/gpu_moe_verify.sh         # needs 4 GPUs
#   MOE_SIZE=tiny bash scripts/gpu_moe_verify.sh                # CPU smoke test (gloo, 4 processes)
#
# Layouts (processes): TP2 EP2 (4), TP1 EP4 (4), TP1 PP2 EP2 (4), TP2 EP2 with expert TP 1 (2: the two
# files Megatron-LM writes), TP1 PP2 VPP2 EP2 (4); each in fp32 and in $MOE_DTYPE compute.
# Env: MOE_SIZE (big | tiny), MOE_DTYPE (bf16), MOE_BATCH (4), MOE_SEQ (512; 16 tiny), WORK (scratch,
#      default a temp dir), OUT (results).
# Results: $OUT/results.txt, one line per run:
#   case=tp2ep2-fp32 nproc=4 rc=0 wall_seconds=.. forward_seconds=.. max_abs_error=.. mean_kl=.. top1_agreement=.. result=PASS
# plus $OUT/<case>.log with each run's full output.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off (the device machines' rule); harmless on CPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SIZE="${MOE_SIZE:-big}"
DTYPE="${MOE_DTYPE:-bf16}"
BATCH="${MOE_BATCH:-4}"
case "$SIZE" in tiny) SEQ="${MOE_SEQ:-16}";; *) SEQ="${MOE_SEQ:-512}";; esac
OUT="${OUT:-$PWD/gpu_moe_verify_out}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
RESULTS="$OUT/results.txt"
: > "$RESULTS"

now() { python -c 'import time; print(time.time())'; }
field() { grep -m1 "^$1=" "$2" | cut -d= -f2- ; }

echo "size=$SIZE dtype=$DTYPE batch=$BATCH seq=$SEQ work=$WORK" | tee "$OUT/setup.txt"
python -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' | tee -a "$OUT/setup.txt"

# the model: transformers builds it; norms near 1, the rest drawn so that routing is decisive
python - "$WORK/hf" "$SIZE" <<'EOF' 2>&1 | tee -a "$OUT/setup.txt" || exit 1
import sys, torch, transformers
out, size = sys.argv[1], sys.argv[2]
dims = (dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
             num_hidden_layers=4, num_local_experts=16, vocab_size=32000) if size != "tiny" else
        dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, num_local_experts=4, vocab_size=128))
torch.manual_seed(0)
model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**dims, num_experts_per_tok=2,
                                                                   max_position_embeddings=4096))
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0, 0.02 if size != "tiny" else 0.15)
model.save_pretrained(out)
print(f"model: MixtralForCausalLM {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dims}")
EOF

layout() {  # name, ckptool from-hf layout flags...
  local name=$1; shift
  ckptool_from_hf=(python -m ckptool from-hf "$WORK/hf" "$WORK/$name" "$@")
  "${ckptool_from_hf[@]}" > "$OUT/from-hf-$name.log" 2>&1 || { echo "from-hf $name failed"; tail -3 "$OUT/from-hf-$name.log"; exit 1; }
}

run_case() {  # name nproc target dtype
  local name=$1 nproc=$2 target=$3 dtype=$4
  local log="$OUT/$name-$dtype.log" start rc wall
  start=$(now)
  python -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m ckptool verify "$target" \
      --reference "$WORK/hf" --dtype "$dtype" --batch "$BATCH" --seq-len "$SEQ" > "$log" 2>&1
  rc=$?
  wall=$(python -c "print(round($(now) - $start, 2))")
  echo "case=$name-$dtype nproc=$nproc rc=$rc wall_seconds=$wall forward_seconds=$(field forward_seconds "$log")" \
       "max_abs_error=$(field max_abs_error "$log") mean_kl=$(field mean_kl "$log")" \
       "top1_agreement=$(field top1_agreement "$log") result=$(field result "$log")" | tee -a "$RESULTS"
}

# name, processes, from-hf flags
CASES=("tp2ep2 4 --tp 2 --ep 2" "tp1ep4 4 --tp 1 --ep 4" "pp2ep2 4 --tp 1 --pp 2 --ep 2"
       "tp2ep2etp1 2 --tp 2 --ep 2 --etp 1" "pp2vpp2ep2 4 --tp 1 --pp 2 --vpp 2 --ep 2")
for c in "${CASES[@]}"; do
  set -- $c
  name=$1 nproc=$2; shift 2
  layout "$name" "$@"
  for dtype in fp32 "$DTYPE"; do
    run_case "$name" "$nproc" "$WORK/$name" "$dtype"
  done
done
echo "results: $RESULTS"
