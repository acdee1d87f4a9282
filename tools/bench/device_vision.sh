#!/usr/bin/env bash
# One GPU call: issue 29's GPU figure (tools/bench/vision_goodput.py): a Qwen2.5-VL-3B-shaped
# model with seeded weights, 4 images per request, E/P/D against aggregated at fixed TTFT/TPOT
# targets, and the embedding handoff's time. Both meshes (5 engines and a tower) share the card.
#   COMMIT=$(git rev-parse --short HEAD) bash tools/bench/device_vision.sh     # on the device
# Needs the carry of tools/bench/device_carry.sh (its transformers keeps qwen2_vl and
# qwen2_5_vl: the image processor) but for .nixl (no NIXL here; with it the tree and carry pass
# 64 MiB): carry .whl .whl-hf .bin. Writes raw files to $OUT (default ./vision-out).
#   KV_GIB=4              KV per engine (four 3B engines with a KV pool share the card)
#   CONC="1 4 16"         closed-loop levels; NREQ="4 16 32" requests per arm and round at each
#   ROUNDS=3 IMAGES=4 PX=448 MAX_TOKENS=64 TTFT_MS=2000 TPOT_MS=50
#   BENCH_S=400           the figure's time limit (the model is made first, ~1 min)
#   MPS=1                 run the meshes under CUDA MPS: their processes' kernels side by side
#                         instead of time-slicing the card
set -uo pipefail
out=${OUT:-$PWD/vision-out}
mkdir -p "$out"
source tools/bench/device_setup.sh
kv=$(( ${KV_GIB:-4} << 30 ))
conc=${CONC:-1 4 16}
nreq=${NREQ:-4 16 32}
run() { echo "\$ $*"; "$@" 2>&1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m tools.bench.raw_file --command "KV_GIB=${KV_GIB:-4} CONC='$conc' NREQ='$nreq' ROUNDS=${ROUNDS:-3} IMAGES=${IMAGES:-4} PX=${PX:-448} MAX_TOKENS=${MAX_TOKENS:-64} TTFT_MS=${TTFT_MS:-2000} TPOT_MS=${TPOT_MS:-50} MPS=${MPS:-0} bash tools/bench/device_vision.sh"
} | tee "$out/header.txt"
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  run nvidia-cuda-mps-control -d | tee -a "$out/header.txt"
  trap 'echo quit | nvidia-cuda-mps-control; tail -n 20 /tmp/mps-log/*.log > "$out/mps.log" 2>&1' EXIT
fi
model=models/qwen2.5-vl-3b
[ -f $model/config.json ] || run python3 -m tools.cli make-model $model --arch qwen2_5_vl --preset qwen2.5-vl-3b \
  --dtype bfloat16 --device cuda | tail -2 | tee -a "$out/header.txt"
rm -rf /tmp/vision-state
# The vision instance's ring (vision.share_bytes) holds 64 requests of 4 images of 448 px
# (256 tokens x 2048 x 2 bytes each): prefill copies from it rather than from kvcache.
run timeout ${BENCH_S:-400} python3 -m tools.cli bench-vision-goodput --model $model --device cuda --dtype bfloat16 \
  --kv-cache-memory-bytes $kv --max-model-len 16384 --images-per-request ${IMAGES:-4} --image-px ${PX:-448} \
  --concurrency $conc --num-requests $nreq --rounds ${ROUNDS:-3} --max-tokens ${MAX_TOKENS:-64} \
  --ttft-target-ms ${TTFT_MS:-2000} --tpot-target-ms ${TPOT_MS:-50} --env INFERMESH_VISION__SHARE_BYTES=$((256 << 20)) \
  --state-dir /tmp/vision-state --out "$out/vision_goodput.txt" --json "$out/vision_goodput.json" \
  2>&1 | tail -n 80 > "$out/vision_goodput.stdout"
tail -n 40 "$out/vision_goodput.stdout"
# The services' errors, if any (a failed request's cause is in its instance's log).
grep -h -i "error\|Traceback" /tmp/vision-state/*/logs/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -8 \
  | tee "$out/errors.txt"
