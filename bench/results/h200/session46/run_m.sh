#!/usr/bin/env bash
# Session 46, one H200 (~6 min): the small MoE path's up projection as a persistent row-split grid
# (HYBRIDSERVE_MOE_ROW_SPLIT=1, kernels/moe_small_triton.py _small_up_rows_kernel): its CUDA tests, then the
# 30B-A3B batch-1 decode step (bench/step_profile.py, one CUDA graph) with the tiled / row-split up kernel,
# alternating, two rounds.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_small.py -k cuda > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$R/gpu_tests.log"
for round in 1 2; do
  for split in 0 1; do
    HYBRIDSERVE_MOE_ROW_SPLIT=$split timeout 90 python3 -u bench/step_profile.py \
      --config bench/configs/nemotron-3-nano-30b-a3b.json --out "$R/step_30b_split${split}_r$round.json" \
      > "$R/step_30b_split${split}_r$round.log" 2>&1
    echo "split=$split round $round rc=$?"; tail -2 "$R/step_30b_split${split}_r$round.log"
  done
done
