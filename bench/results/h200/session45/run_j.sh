#!/usr/bin/env bash
# Planned in session 45 for the next session (its device time was spent; ~2.5 min on one H200): decode graphs
# launched in pieces (HYBRIDSERVE_STAGED_GRAPHS=1, engine/cuda_graphs.py stage_cuts) -- the CUDA graph tests (the
# pieces replay as the eager step does), then the 9B's engine steps at batch 1 / 4 / 8 (1024-token contexts) in
# pieces vs one graph per step, alternating, in one process. If the pieces win, make HYBRIDSERVE_STAGED_GRAPHS=1
# the default and A/B the served step (bench/serve_cache_ab.sh).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 55 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graphs.py \
  -k "equals_eager or in_pieces" > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
(cd bench && timeout 85 python3 staged_graphs.py --batches 1 4 8 --context 1024 --steps 30 --rounds 3 \
  --out "$R/staged_graphs.json" > "$R/staged_graphs.log" 2>&1)
echo "staged rc=$?"; tail -5 "$R/staged_graphs.log"
