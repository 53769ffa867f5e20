#!/usr/bin/env bash
# Session 43's plan for the next device call (one H200, ~8 min): the Gumbel-max sampler on the GPU. Its CUDA tests
# and the engine / spec-decode CUDA tests (the sampler changed under them); its tail against the inverse-CDF path
# it replaced (bench/sampling.py, floor beside); the engine replaying the served workload (decode steps against
# a/ of this session, same settings); served TPOT against the offline step.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampling_triton.py tests/engine/test_cuda_engine.py \
  tests/engine/test_cuda_spec_decode.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$R/gpu_tests.log"
(cd bench && timeout 120 python3 sampling.py --json "$R/sampling.json" > "$R/sampling.log" 2>&1)
echo "sampling rc=$?"; cat "$R/sampling.log"
(cd bench && timeout 200 python3 engine_trace.py --rate 8 --num-prompts 160 --input-len 1024 --output-len 64 \
  --gc-freeze --caching on --out "$R/trace" > "$R/trace.log" 2>&1)
echo "trace rc=$?"; grep "^cache" "$R/trace.log" | cut -c1-600
