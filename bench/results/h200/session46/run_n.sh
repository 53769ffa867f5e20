#!/usr/bin/env bash
# Planned in session 46 for the next session (its device time was spent; one H200, ~4 min): the small MoE up
# kernel's shared-expert programs launched first and computing before the router wait
# (HYBRIDSERVE_MOE_EARLY_SHARED=1, kernels/moe_small_triton.py): its CUDA tests, then the 30B-A3B batch-1 decode
# step (bench/step_profile.py, one CUDA graph) with it off / on, alternating, two rounds. If it wins, make it the
# default (early_shared_enabled) and record the step in bench/results/h200/decode_step_b1/README.md.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_small.py -k cuda > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$R/gpu_tests.log"
for round in 1 2; do
  for early in 0 1; do
    HYBRIDSERVE_MOE_EARLY_SHARED=$early timeout 70 python3 -u bench/step_profile.py \
      --config bench/configs/nemotron-3-nano-30b-a3b.json --out "$R/step_30b_early${early}_r$round.json" \
      > "$R/step_30b_early${early}_r$round.log" 2>&1
    echo "early=$early round $round rc=$?"; grep -E "replay|_small_" "$R/step_30b_early${early}_r$round.log" | head -3
  done
done
