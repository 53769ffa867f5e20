#!/usr/bin/env bash
# Session 46, one H200 (~9 min): issue 20's prefix-cache criteria at HEAD -- the shared-prefix and multi-turn gains
# (cache on vs off, the session-35 workloads), then cache off vs on on unique prompts, ABBA over 2 more rounds x 2
# passes (1024/64 at 8 req/s; call k's 2 rounds are the first half).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
KIND=shared-prefix KIND_ARGS="--num-groups 4 --prefix-len 2048" WORKLOADS=64:64 RATES=8 NUM_PROMPTS=64 \
  timeout 150 bash bench/serve_gpu.sh "$R/shared" colocated-1gpu colocated-1gpu-nocache > "$R/shared.log" 2>&1
echo "shared rc=$?"
KIND=multi-turn KIND_ARGS="--num-turns 4 --prefix-len 512" WORKLOADS=128:64 RATES=4 NUM_PROMPTS=48 \
  timeout 170 bash bench/serve_gpu.sh "$R/multi" colocated-1gpu-nocache colocated-1gpu > "$R/multi.log" 2>&1
echo "multi rc=$?"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu" ROUNDS=2 ABBA=1 NUM_PROMPTS=120 \
  timeout 240 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; grep -A4 '"on_over_off"' "$R/ab/ab_summary.json"
