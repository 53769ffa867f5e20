#!/usr/bin/env bash
# Session 45, call i (one H200, ~4 min): where the cache-on decode step's extra launch time goes (call h: launch
# 0.31-0.39 ms off, 0.42-0.47 on, GPU wait equal). One worker, cache off then on (late hand-off, the default),
# serves 1024/64 at 8 req/s while its loop profiles 40 busy steps in the steady state (HYBRIDSERVE_PROFILE_STEPS=
# 600:40): op tables and Perfetto traces in $R/prof-<deployment>/.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
for deployment in colocated-1gpu-nocache colocated-1gpu; do
  HYBRIDSERVE_PROFILE_DIR="$R/prof-$deployment" HYBRIDSERVE_PROFILE_STEPS=600:40 PASSES=a NUM_PROMPTS=100 \
    WORKLOADS=1024:64 RATES=8 timeout 170 bash bench/serve_gpu.sh "$R/serve" "$deployment" > "$R/$deployment.log" 2>&1
  echo "$deployment rc=$?"; ls -la "$R/prof-$deployment" 2>/dev/null
done
