#!/usr/bin/env bash
# The H200 figures of docs/perf/README.md, each stage one call of the device machine
# (its python3 has torch, triton, transformers, grpcio; nothing else of the mesh):
#
#   bash tools/bench/h200.sh engine   # tests/gpu, bench-gpu's whole-engine rows, the KV tiers
#   bash tools/bench/h200.sh mesh     # bench-mesh: engine / http / mesh, 1k and 8k prompts
#                                     (--num-requests per target and round: 3 timed rounds after a warm-up
#                                     and a dropped round; the headline is mesh over http)
#   bash tools/bench/h200.sh final    # the mesh, the tiers, the batch-64 engine row, then tests/gpu
#   bash tools/bench/h200.sh check    # tests/gpu and bench-spec on the trained pair only
#   bash tools/bench/h200.sh last     # bench-spec, tests/gpu, then the tiers (8B drawn last)
#   bash tools/bench/h200.sh bench-spec   # issue 13's full table (batch 1 4 16 64, γ 2 4 6)
#   bash tools/bench/h200.sh cond     # conditional disaggregation against the engine; the invariant matmul
#   bash tools/bench/h200.sh v4       # the V4-shaped model's figures (v4_bench), the invariant matmul's tile sweep
#   bash tools/bench/h200.sh retune   # the invariant mode's cost, the 8k mesh with QUEUE=1
#   bash tools/bench/h200.sh close    # tests/gpu, then issue 13's full table
#   bash tools/bench/h200.sh wrap     # issue 13's table, issue 14's cost, issue 10's 8k-16 and 1k-1
#   bash tools/bench/h200.sh mps      # issue 10's 1k-64 and 8k-16, the card time-sliced and then under MPS
#   bash tools/bench/h200.sh routing  # multi-turn chats: always vs conditionally disaggregated (routing_bench)
#   bash tools/bench/h200.sh spec     # tests/gpu, bench-spec on the trained pair, the 8B SPS and its
#                                     # simulation, batch-invariant mode's cost
#
# Carried beside the checkout (git-ignored): .whl/ (the mesh's wheels, ../shared/STACK.md,
# and transformers==5.24.0: the machine's own 5.17 computes GPT-OSS differently, and the
# parity tests' reference is the version we pin)
# and .bin/nats-server. The 8B-shaped checkpoint is drawn on the GPU into models/llama3-8b
# (kept while the machine stays warm). Logs and figures go to $OUT (default ./h200-out).
set -euo pipefail
stage=${1:?usage: h200.sh engine|mesh}
out=${OUT:-$PWD/h200-out}
mkdir -p "$out"
log="$out/$stage.log"
rm -rf /tmp/mesh-8k
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" PATH="$PWD/.bin:$PATH" PYTHONUNBUFFERED=1
model=models/llama3-8b
run() { echo "\$ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
# The raw file's header (tools/bench/raw_file.py). The device machine gets a copy of the tree
# without git: pass the commit, INFERMESH_COMMIT=$(git rev-parse HEAD) bash tools/bench/h200.sh ...
python3 -m tools.bench.raw_file --command "bash tools/bench/h200.sh $*" | tee -a "$log"
if [ "$stage" != check ] && [ "$stage" != last ] && [ "$stage" != bench-spec ] && [ "$stage" != v4 ] && [ "$stage" != close ] && [ ! -f "$model/model.safetensors.index.json" ] && [ ! -f "$model/model.safetensors" ]; then
  start=$(date +%s)
  run python3 -m tools.cli make-model "$model" --preset llama3-8b --dtype bfloat16 --device cuda
  echo "make-model took $(( $(date +%s) - start )) s" | tee -a "$log"
fi

case "$stage" in
engine)
  run python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu
  run python3 -m tools.cli bench-gpu --no-transformers --out "$out" \
    --rows decode:1x1024,prefill:8192,engine-decode:1x1024,engine-decode:64x1024,engine-prefill:8192
  run python3 -m tools.bench.tier_bench --model "$model" --device cuda --dtype bfloat16 \
    --prompt-len 4096 --repeats 3 --out "$out"
  ;;
mesh | final)
  common=(--model "$model" --dtype bfloat16 --device cuda --output-len 128)
  # 1k: four engines on the card (in-process, http, prefill, decode), 10 GiB of KV each.
  run python3 -m tools.cli bench-mesh "${common[@]}" --prompt-len 1024 --concurrency 1 16 64 \
    --num-requests 4 32 64 --kv-cache-memory-bytes $((10 << 30)) --json "$out/mesh_1k.json"
  # 8k: 16 clients hold 133k tokens of KV; three engines fit: the in-process one is left out (never the baseline).
  run python3 -m tools.cli bench-mesh "${common[@]}" --prompt-len 8192 --concurrency 1 16 \
    --num-requests 2 16 --targets http mesh --kv-cache-memory-bytes $((18 << 30)) --json "$out/mesh_8k.json" \
    --state-dir /tmp/mesh-8k
  tar czf "$out/traces_8k.tgz" -C /tmp/mesh-8k mesh/traces mesh/logs
  if [ "$stage" = final ]; then  # in the order of their worth, should the call's time run out
    run python3 -m tools.bench.tier_bench --model "$model" --device cuda --dtype bfloat16 \
      --prompt-len 4096 --repeats 3 --out "$out" || true
    run python3 -m tools.cli bench-gpu --no-transformers --out "$out" --rows engine-decode:64x1024
    run python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu
  fi
  ;;
cond)  # issue 10: conditional disaggregation on the one GPU (QUEUE tokens queued on prefill: decode prefills),
  # then issue 14's invariant matmul buckets (tests/gpu and the cost)
  common=(--model "$model" --dtype bfloat16 --device cuda --output-len 128 --targets http mesh)
  export INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS=${QUEUE:-8192}
  echo "INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS=$INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS" | tee -a "$log"
  run timeout 170 python3 -m tools.cli bench-mesh "${common[@]}" --prompt-len 1024 --concurrency 64 \
    --num-requests 64 --kv-cache-memory-bytes $((10 << 30)) --json "$out/mesh_cond_1k.json" || true
  run timeout 150 python3 -m tools.cli bench-mesh "${common[@]}" --prompt-len 8192 --concurrency 16 \
    --num-requests 16 --kv-cache-memory-bytes $((18 << 30)) --json "$out/mesh_cond_8k.json" || true
  unset INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS
  run timeout 100 python3 -m pytest -q -s -p no:cacheprovider --noconftest tests/gpu/test_gpu_invariant_matmul.py \
    tests/gpu/test_gpu_batch_invariant.py || true
  run timeout 120 python3 -m tools.bench.batch_invariant_bench --model "$model" --device cuda --dtype bfloat16 \
    --batch 1 8 32 --prompt-len 256 --max-tokens 32 --matmul || true
  ;;
retune)  # issue 14's cost with the retuned matmul tiles, the 8k mesh with QUEUE (default 1) tokens
  run timeout 130 python3 -m tools.bench.batch_invariant_bench --model "$model" --device cuda --dtype bfloat16 \
    --batch 1 8 32 --prompt-len 256 --max-tokens 32 --matmul || true
  run env INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS="${QUEUE:-1}" timeout 160 python3 -m tools.cli bench-mesh \
    --model "$model" --dtype bfloat16 --device cuda --output-len 128 --targets http mesh \
    --prompt-len 8192 --concurrency 16 --num-requests 16 --kv-cache-memory-bytes $((18 << 30)) \
    --json "$out/mesh_cond_8k.json" || true
  ;;
v4)  # issue 12: the V4-shaped model (15B, 8 layers, 64 experts) in the engine; then issue 14's matmul tile sweep
  run timeout 330 python3 -m tools.bench.v4_bench --preset v4-flash-8l --model models/v4-flash-8l --device cuda \
    --out "$out" || true
  rm -rf models/v4-flash-8l
  run timeout 220 python3 -m tools.bench.batch_invariant_bench --device cuda --dtype bfloat16 --batch 1 \
    --max-tokens 4 --matmul-sweep || true
  ;;
wrap)  # issue 13's table (interleaved, an A/A control), issue 14's cost with the persistent
  # matmul, issue 10's 8k-16 (conditional disaggregation, QUEUE=1) and 1k-1 (prompts
  # up to 1024 tokens prefilled on decode)
  run timeout 170 python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 4 16 64 --spec-tokens 2 4 6 --max-tokens 64 --repeats 5 --json "$out/spec_draft.json" || true
  run timeout 110 python3 -m tools.bench.batch_invariant_bench --model "$model" --device cuda --dtype bfloat16 \
    --batch 1 8 32 --prompt-len 256 --max-tokens 32 --matmul || true
  common=(--model "$model" --dtype bfloat16 --device cuda --output-len 128 --targets http mesh)
  run env INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS=1 timeout 150 python3 -m tools.cli bench-mesh "${common[@]}" \
    --prompt-len 8192 --concurrency 16 --num-requests 16 --kv-cache-memory-bytes $((18 << 30)) \
    --json "$out/mesh_cond_8k.json" || true
  run env INFERMESH_BALANCER__LOCAL_PREFILL_MAX_TOKENS=1024 timeout 70 python3 -m tools.cli bench-mesh "${common[@]}" \
    --prompt-len 1024 --concurrency 1 --num-requests 4 --kv-cache-memory-bytes $((10 << 30)) \
    --json "$out/mesh_cond_1k1.json" || true
  ;;
mps)  # issue 10: the mesh's two processes time-slice the one card (each step of one waits out the
  # other's). Under MPS their kernels run on it at once, as a single engine's would. 1k-64 and 8k-16
  # (the levels below 0.95), conditional disaggregation on (QUEUE=1), without MPS then with it,
  # engine and mesh side by side in each. A machine without nvidia-cuda-mps-control runs the first half.
  common=(--model "$model" --dtype bfloat16 --device cuda --output-len 128 --targets http mesh)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  for sharing in timeslice mps; do
    if [ "$sharing" = mps ]; then
      command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control: MPS not run" | tee -a "$log"; break; }
      run nvidia-cuda-mps-control -d || break
      if ! python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"; then
        echo "CUDA does not start under MPS here: MPS not run" | tee -a "$log"
        echo quit | nvidia-cuda-mps-control || true
        break
      fi
    fi
    run env INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS=1 timeout 125 python3 -m tools.cli bench-mesh "${common[@]}" \
      --prompt-len 1024 --concurrency 64 --num-requests 64 --kv-cache-memory-bytes $((10 << 30)) \
      --json "$out/mesh_1k64_$sharing.json" || true
    run env INFERMESH_BALANCER__LOCAL_PREFILL_QUEUE_TOKENS=1 timeout 135 python3 -m tools.cli bench-mesh "${common[@]}" \
      --prompt-len 8192 --concurrency 16 --num-requests 16 --kv-cache-memory-bytes $((18 << 30)) \
      --json "$out/mesh_8k16_$sharing.json" || true
    if [ "$sharing" = mps ]; then
      # Whether the processes ran under it: the daemon logs each client that connected.
      echo "MPS clients connected: $(grep -ci 'new client' "$CUDA_MPS_LOG_DIRECTORY/control.log" || true)" | tee -a "$log"
      echo quit | nvidia-cuda-mps-control || true
    fi
  done
  ;;
routing)  # issue 10: conversations through two meshes at once, always disaggregated against conditional
  # disaggregation; 1 prefill + 1 decode each (four 8B engines, 8 GiB of KV each: six would not fit)
  run timeout 500 python3 -m tools.bench.routing_bench --model "$model" --device cuda --dtype bfloat16 \
    --decode 1 --kv-cache-memory-bytes $((8 << 30)) --conversations 16 --turns 4 --concurrency 8 \
    --input-len 256 --output-len 256 --max-local-tokens 1024 --json "$out/routing.json" || true
  ;;
close)  # a session's last call: tests/gpu at the final commit, then issue 13's full table
  run timeout 360 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu || true
  run timeout 200 python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 4 16 64 --spec-tokens 2 4 6 --max-tokens 64 --json "$out/spec_draft.json" || true
  ;;
bench-spec)  # issue 13's table: batch 1 4 16 64, γ 2 4 6, on the trained pair (no 8B checkpoint needed)
  run python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 4 16 64 --spec-tokens 2 4 6 --max-tokens 64 --json "$out/spec_draft.json"
  ;;
last)  # the end of a session short of device time, in the order of their worth: bench-spec, tests/gpu, the tiers
  run timeout 150 python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 16 64 --spec-tokens 2 4 --max-tokens 64 --json "$out/spec_draft.json" || true
  run timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu || true
  run python3 -m tools.cli make-model "$model" --preset llama3-8b --dtype bfloat16 --device cuda
  run timeout 150 python3 -m tools.bench.tier_bench --model "$model" --device cuda --dtype bfloat16 \
    --prompt-len 4096 --repeats 3 --out "$out" || true
  ;;
check)  # tests/gpu, then bench-spec on the trained pair (no 8B checkpoint needed)
  run timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu || true
  run timeout 240 python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 16 64 --spec-tokens 2 4 --max-tokens 64 --json "$out/spec_draft.json" || true
  ;;
spec)  # issue 13's figures and issue 14's batch-invariance cost, then tests/gpu
  run timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu || true
  run timeout 200 python3 -m tools.bench.spec_bench --model models/trained/target --draft models/trained/draft \
    --batch 1 16 64 --spec-tokens 2 4 --max-tokens 64 --json "$out/spec_draft.json" || true
  run timeout 90 python3 -m tools.bench.sps_sim --model "$model" --acceptance "$out/spec_draft.json" \
    --json "$out/sps_8b.json" || true
  run timeout 120 python3 -m tools.bench.batch_invariant_bench --model "$model" --device cuda --dtype bfloat16 \
    --batch 1 8 32 --prompt-len 256 --max-tokens 32 || true
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac
