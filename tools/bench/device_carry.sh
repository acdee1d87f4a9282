#!/usr/bin/env bash
# Builds, on the development machine, the git-ignored folders a GPU call carries beside the
# checkout (the device machine cannot download; the carry is 64 MiB at most with the tree):
#
#   .whl/      the mesh's own dependencies the device's python3 (3.12, torch + CUDA 13) lacks
#   .whl-hf/   transformers==5.24.0 trimmed to the model families the tests compare against
#              (the device's own 5.17 computes GPT-OSS differently)
#              and keeps Qwen2.5-VL's image processor (qwen2_vl, qwen2_5_vl: bench-vision-goodput)
#   .nixl/     nixl-cu13 (the device's torch is CUDA 13) without its storage plugins, its EP
#              kernels and InfiniBand-only UCX modules: UCX's cuda_ipc, cuda_copy, shm and tcp stay
#   .bin/      nats-server (Debian's binary runs there)
#
# Then, on the device: `bash tools/bench/device_setup.sh` installs them under /tmp/site.
# Run from the repository root: bash tools/bench/device_carry.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.whl-hf/\n/.nixl/\n/.bin/\n' >> .git/info/exclude
py=(--only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir -p .whl .whl-hf .nixl .bin
python3 -m pip download -q "${py[@]}" -d .whl \
  protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 nats-py==2.16.0 lmdb==3.0.0 \
  xxhash==4.1.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-instrumentation==0.66b2 \
  opentelemetry-instrumentation-grpc==0.66b2 wrapt==2.5.2 fastapi==0.165.0 starlette==1.10.0 \
  uvicorn==0.55.0 anyio==4.16.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc pytest==9.2.0 \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
  pytest-asyncio==1.5.0 iniconfig pluggy packaging

# transformers: keep the package and the model folders the parity tests import.
python3 -m pip download -q "${py[@]}" -d "$tmp/hf" transformers==5.24.0
(cd "$tmp/hf" && mkdir t && cd t && unzip -q ../transformers-*.whl \
  && keep='^(__init__.py|auto|llama|qwen2|qwen3|qwen3_moe|mistral|gpt_oss|deepseek_v3|deepseek_v4|encoder_decoder|qwen2_moe|mixtral|qwen2_vl|qwen2_5_vl)$' \
  && for d in transformers/models/*; do basename "$d" | grep -Eq "$keep" || rm -rf "$d"; done \
  && rm -f "$root"/.whl-hf/*.whl && zip -qr "$root/.whl-hf/transformers-5.24.0-py3-none-any.whl" .)

# NIXL for CUDA 13, trimmed: only the UCX and POSIX plugins and what they link.
python3 -m pip download -q "${py[@]}" -d "$tmp/nixl" nixl-cu13==1.5.1
mkdir "$tmp/nx" && (cd "$tmp/nx" && unzip -q "$tmp"/nixl/nixl_cu13-*.whl && rm -rf nixl_ep_cu13 \
  && for d in .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl; do
       find "$d" -type f ! -name libplugin_UCX.so ! -name libplugin_POSIX.so -delete; done \
  && rm -f nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/libuct_ib_efa* nixl_cu13.libs/ucx/libuct_ib_mlx5_gd* \
  && for _ in 1 2 3; do
       need=$(find . -name '*.so*' -type f -exec readelf -d {} \; 2>/dev/null | awk '/NEEDED/ {gsub(/[][]/, "", $5); print $5}' | sort -u)
       for f in nixl_cu13.libs/*.so*; do echo "$need" | grep -qx "$(basename "$f")" || rm "$f"; done
     done)
tar cJf .nixl/nixl_cu13.tar.xz -C "$tmp/nx" .

cp "$(command -v nats-server || echo /usr/sbin/nats-server)" .bin/nats-server
du -sh .whl .whl-hf .nixl .bin
