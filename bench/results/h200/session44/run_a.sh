#!/usr/bin/env bash
# Session 44, call a (one H200): the Gumbel-max sampler's CUDA tests with the engine / spec-decode CUDA tests,
# its GPU tail against the inverse-CDF path (bench/sampling.py), and whether KV page placement (packed vs spread
# over the pool) moves the decode step, cache off and on (bench/page_spread.py).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
nvidia-smi > "$R/nvidia-smi.txt"
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampling_triton.py tests/engine/test_cuda_engine.py \
  tests/engine/test_cuda_spec_decode.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
(cd bench && timeout 90 python3 sampling.py --json "$R/sampling.json" > "$R/sampling.log" 2>&1)
echo "sampling rc=$?"; tail -30 "$R/sampling.log"
(cd bench && timeout 240 python3 page_spread.py --batches 1,5,8 --rounds 4 --profile --json "$R/page_spread.json" \
  > "$R/page_spread.log" 2>&1)
echo "page_spread rc=$?"; python3 -c "
import json,sys; d=json.load(open('$R/page_spread.json')); print(json.dumps(d['decode_step_ms_p50'])); print(json.dumps(d['profiles']))" || tail -20 "$R/page_spread.log"
