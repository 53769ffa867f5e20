#!/usr/bin/env bash
# Plan for a device call after run_f.sh (one H200, ~4 min): where a served decode step's launch phase goes. One
# cache-on worker serves 1024/64 at 8 req/s while its loop profiles 40 busy steps in the steady state with Python
# frames of every thread (HYBRIDSERVE_PROFILE_STEPS=1000:40:stack), once with the outputs handed off at once and
# once late (HYBRIDSERVE_LATE_HANDOFF via the -late deployment): traces in $R/prof*/ (open in Perfetto).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
for deployment in colocated-1gpu colocated-1gpu-late; do
  HYBRIDSERVE_PROFILE_DIR="$R/prof-$deployment" HYBRIDSERVE_PROFILE_STEPS=1000:40:stack PASSES=a NUM_PROMPTS=120 \
    WORKLOADS=1024:64 RATES=8 timeout 200 bash bench/serve_gpu.sh "$R/serve" "$deployment" > "$R/$deployment.log" 2>&1
  echo "$deployment rc=$?"; ls "$R/prof-$deployment" 2>/dev/null
  head -30 "$R/prof-$deployment"/*.txt 2>/dev/null | cut -c1-200
done
