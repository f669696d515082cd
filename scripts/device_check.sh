#!/usr/bin/env bash
# The trainer's CUDA/nccl path on a GPU machine (the device tool's machine): train, save, consolidate,
# resume, fp16/fp32/NVMe variants, the same runs on CPU beside them, the round trip at 1 rank, and the
# refusal of two ranks on one GPU. Each step is timed out on its own; the log goes to $OUT/device_check.log.
#   OUT=/tmp/out PY=python3 bash scripts/device_check.sh [cuda|cpu]
set -u
DEV=${1:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/device_check}
W=$(mktemp -d)
mkdir -p "$OUT"
LOG=$OUT/device_check.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME TIMEOUT CMD...: run, log its output, its exit code and wall time
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" >>"$LOG"
    local t0=$(date +%s.%N)  # bc is not on every machine: python computes the wall time
    timeout -s KILL "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")s" >>"$LOG"
}
train() { echo "$PY" -m torch.distributed.run --nproc-per-node "$1" --master-port 29611 -m zckpt train; }
T1=$(train 1); T2=$(train 2)
{ date; uname -r; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"; } >>"$LOG" 2>&1
step bf16_train 240 $T1 --out "$W/gpu" --steps 20 --save-every 10 --dtype bf16 --tie-embeddings --device "$DEV"
step bf16_train_cpu 240 $T1 --out "$W/cpu" --steps 20 --save-every 10 --dtype bf16 --tie-embeddings --device cpu
step consolidate 120 "$PY" -m zckpt consolidate "$W/gpu" "$W/gpu_out"
step verify 120 "$PY" -m zckpt verify "$W/gpu"
step inspect 120 "$PY" -m zckpt inspect "$W/gpu"
step resume 240 $T1 --out "$W/gpu" --steps 30 --resume "$W/gpu" --dtype bf16 --tie-embeddings --device "$DEV"
step fp32_train 240 $T1 --out "$W/fp32" --steps 10 --dtype fp32 --device "$DEV"
step fp32_train_cpu 240 $T1 --out "$W/fp32cpu" --steps 10 --dtype fp32 --device cpu
step fp32_diff 120 "$PY" -m zckpt diff "$W/fp32" "$W/fp32cpu"
step fp16_train 240 $T1 --out "$W/fp16" --steps 10 --dtype fp16 --device "$DEV"
step nvme_train 240 $T1 --out "$W/nvme" --steps 6 --dtype bf16 --dim 512 --layers 2 --nvme-path "$W/swap" --nvme-params --device "$DEV"
step nvme_consolidate 120 "$PY" -m zckpt consolidate "$W/nvme" "$W/nvme_out" --swap-folder "$W/swap"
step big_train 300 $T1 --steps 8 --dtype bf16 --layers 8 --dim 1024 --heads 16 --vocab 8192 --seq-len 256 --micro-batch 8 --device "$DEV"
step big_train_cpu 300 $T1 --steps 3 --dtype bf16 --layers 8 --dim 1024 --heads 16 --vocab 8192 --seq-len 256 --micro-batch 8 --device cpu
step roundtrip_1rank 300 "$PY" scripts/roundtrip.py --from-world 1 --to-world 1 --steps 6 --save-at 3 --dtype bf16
step two_ranks_one_gpu 120 $T2 --steps 2 --device "$DEV"
# the README's chain, resumed without the model options (taken from the checkpoint)
step readme_chain 240 $T1 --out "$W/chain" --steps 20 --save-every 10 --dtype bf16 --tie-embeddings --device "$DEV"
step readme_resume 240 $T1 --out "$W/chain" --steps 30 --resume "$W/chain" --device "$DEV"
step readme_inspect 60 "$PY" -m zckpt inspect "$W/chain"
rm -rf "$W"
