#!/usr/bin/env bash
# Session 45, call j (one H200, <= 150 s: the session's last device time): decode graphs launched in pieces (the new
# default, engine/cuda_graphs.py launch_stages) -- the CUDA graph tests (pieces replay as the eager step), then the
# 9B's engine steps at batch 1 / 4 / 8 (1024-token contexts) staged vs one graph per step, alternating, one process.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 55 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graphs.py \
  -k "equals_eager or staging_is_off" > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
(cd bench && timeout 85 python3 staged_graphs.py --batches 1 4 8 --context 1024 --steps 30 --rounds 3 \
  --out "$R/staged_graphs.json" > "$R/staged_graphs.log" 2>&1)
echo "staged rc=$?"; tail -5 "$R/staged_graphs.log"
