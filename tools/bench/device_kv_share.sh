#!/usr/bin/env bash
# One GPU call: the direct KV copy between PID namespaces (kv_share_dir: the cache made by
# CUDA's VMM API, its memory handed over a unix socket), measured as deployed.
#   COMMIT=$(git rev-parse --short HEAD) bash tools/bench/device_kv_share.sh     # on the device
# Needs the carry of tools/bench/device_carry.sh. Writes raw files to $OUT (default ./kv-share-out).
#   STAGES="tests copy nixlw mesh8k"   which parts (default: tests copy mesh)
#   KV_GIB=5                     KV per engine (three 8B engines share the card)
#   MPS=1                        run the mesh stages under CUDA MPS: prefill and decode of one card
#                                then run kernels side by side instead of time-slicing the card
#   TESTS=all                    the tests stage runs all of tests/gpu, not only the peer tests
set -uo pipefail
out=${OUT:-$PWD/kv-share-out}
mkdir -p "$out"
source tools/bench/device_setup.sh
stages=${STAGES:-tests copy mesh}
kv=$(( ${KV_GIB:-5} << 30 ))
run() { echo "\$ $*"; "$@" 2>&1; }
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m tools.bench.raw_file --command "STAGES='$stages' KV_GIB=${KV_GIB:-5} MPS=${MPS:-0} TESTS=${TESTS:-peer} CONC1K='${CONC1K:-1 16 64}' NREQ1K='${NREQ1K:-4 32 64}' CONC8K='${CONC8K:-1 4}' NREQ8K='${NREQ8K:-2 4}' bash tools/bench/device_kv_share.sh"
} | tee "$out/header.txt"
mps_start() {  # once, before the first mesh stage (tests/gpu runs without it)
  [ "${MPS:-0}" = 1 ] && [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  run nvidia-cuda-mps-control -d 2>&1 | tee -a "$out/header.txt"
  echo "MPS control daemon: $(command -v nvidia-cuda-mps-control)" | tee -a "$out/header.txt"
  trap 'echo quit | nvidia-cuda-mps-control; tail -n 20 /tmp/mps-log/*.log > "$out/mps.log" 2>&1' EXIT
}
for stage in $stages; do
  case $stage in
  tests)
    what=tests/gpu/test_gpu_peer_transfer.py; [ "${TESTS:-}" = all ] && what=tests/gpu
    run timeout 300 python3 -m pytest -q -s -p no:cacheprovider --noconftest -rfE --tb=short \
      $what 2>&1 | tee "$out/gpu_tests.log" ;;
  copy)
    for ns in "" --pid-namespace "" --pid-namespace; do
      run timeout 120 python3 -m tools.bench.peer_copy_bench --reps 5 $ns
    done 2>&1 | tee "$out/peer_copy.log" ;;
  nixlw)  # a put into scattered blocks, checked by reading them back (one PID namespace: cuda_ipc)
    for run in 8 0; do
      run timeout 120 python3 -m tools.bench.nixl_bench --op write --one-pid-namespace --max-run $run --reps 3
    done 2>&1 | tee "$out/nixl_write.log" ;;
  mesh | mesh8k)
    mps_start
    model=models/llama3-8b
    [ -f $model/config.json ] || run python3 -m tools.cli make-model $model --preset llama3-8b --dtype bfloat16 --device cuda | tail -2
    if [ $stage = mesh ]; then len=(--prompt-len 1024 --concurrency ${CONC1K:-1 16 64} --num-requests ${NREQ1K:-4 32 64}); else
      len=(--prompt-len 8192 --concurrency ${CONC8K:-1 4} --num-requests ${NREQ8K:-2 4}); fi
    rm -rf /tmp/kv-share /tmp/mesh-state
    INFERMESH_ENGINE__KV_SHARE_DIR=/tmp/kv-share run timeout ${MESH_S:-400} python3 -m tools.cli bench-mesh \
      --model $model --dtype bfloat16 --device cuda --output-len 128 --targets http mesh \
      --kv-cache-memory-bytes $kv "${len[@]}" --pid-namespaces --state-dir /tmp/mesh-state \
      --json "$out/$stage.json" 2>&1 | tee "$out/$stage.log"
    # Which path each request's KV took, from the decode spans.
    python3 - <<'EOF' 2>&1 | tee -a "$out/$stage.log"
import collections, glob, json
paths, copy = collections.Counter(), []
for f in glob.glob("/tmp/mesh-state/**/traces/*.jsonl", recursive=True):
    for line in open(f):
        try:
            s = json.loads(line)
        except ValueError:
            continue
        a = s.get("attributes", {})
        if s.get("name") == "decode" and a.get("prefill.local"):
            paths["local (decode computed the prompt)"] += 1
        elif s.get("name") == "decode" and "kv.path" in a:
            paths[a["kv.path"]] += 1
            if a.get("kv.copy_ms") and a.get("kv.loaded_bytes"):
                copy.append(a["kv.loaded_bytes"] / a["kv.copy_ms"] / 1e6)
print("decode spans by kv.path:", dict(paths))
if copy:
    copy.sort()
    print(f"direct copy GB/s over {len(copy)} requests: min {copy[0]:.1f} median {copy[len(copy)//2]:.1f} max {copy[-1]:.1f}")
EOF
    grep -h -i "error\|Traceback" /tmp/mesh-state/mesh/logs/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -5 | tee -a "$out/$stage.log"
    ;;
  esac
done
