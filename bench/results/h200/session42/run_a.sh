#!/usr/bin/env bash
# Session 42, call A (one H200): GPU tests of the prefill graphs and the early prefix-cache commit, then engine
# variants side by side in one process (prefill graphs split / folded decode rows / prefix cache on / eager).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$R/gpu.csv"
timeout 200 python -m pytest -q tests/engine/test_cuda_prefill_graphs.py tests/statepool/test_gpu_prefix.py \
  > "$R/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" >> "$R/gpu_tests.log"
tail -3 "$R/gpu_tests.log"
cd bench && timeout 330 python3 prefill_graph_ab.py --modes graphs,fold,cache,eager --lens 128,512,1024 \
  --decode-rows 4 --repeats 7 --gpu-memory-gb 8 --out "$R/modes_ab.json" > "$R/modes_ab.log" 2>&1
echo "ab rc=$?"; tail -40 "$R/modes_ab.log" | head -60
