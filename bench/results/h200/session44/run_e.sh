#!/usr/bin/env bash
# Plan for the next device call (one H200, <= 10 min; not run in session 44, whose device time was spent): the
# fused gated-norm + out_proj kernel's CUDA tests, then its effect on the 30B-A3B and 9B batch-1 decode steps
# (bench/step_profile.py with HYBRIDSERVE_FUSED_NORM_LINEAR=0 / 1, alternating, two rounds). run_f.sh is the call
# after it (the served cache A/B).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_linear_triton.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$R/gpu_tests.log"
for round in 1 2; do
  for fused in 0 1; do
    for cfg in nemotron-3-nano-30b-a3b nemotron-nano-9b-v2; do
      HYBRIDSERVE_FUSED_NORM_LINEAR=$fused timeout 100 python3 bench/step_profile.py \
        --config bench/configs/$cfg.json --out "$R/step_${cfg}_fused${fused}_r$round.json" > "$R/step_${cfg}_fused${fused}_r$round.log" 2>&1
      echo "$cfg fused=$fused round $round rc=$?"; grep -i "replay\|ms" "$R/step_${cfg}_fused${fused}_r$round.log" | tail -2
    done
  done
done
