#!/usr/bin/env bash
# Session 47, call 5 (one H200): this session's tree as committed -- the MoE layer at 1-128 tokens and the step
# (bench/moe.py), the 30B-A3B batch-1 step twice (bench/step_profile.py), then the CUDA tests of the engine (graphs,
# prefill graphs, MTP), the MoE models and the small MoE path, which q/k/v's fused weight and the early shared
# programs run through.
set -uo pipefail
R=$1; mkdir -p "$R"
timeout 100 python3 -u bench/moe.py --device cuda --skip fp8_decode fp8_prefill prefill --out "$R/moe.json" > "$R/moe.log" 2>&1
echo "moe rc=$?"; grep -E "^\|| = " "$R/moe.log" | head -10
for round in 1 2; do
  timeout 60 python3 -u bench/step_profile.py --config bench/configs/nemotron-3-nano-30b-a3b.json \
    --out "$R/30b_$round.json" > "$R/30b_$round.log" 2>&1
  echo "30b_$round rc=$?"; grep replay "$R/30b_$round.log"
done
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/engine/test_cuda_graphs.py \
  tests/engine/test_cuda_engine.py tests/engine/test_cuda_spec_decode.py tests/engine/test_cuda_prefill_graphs.py \
  tests/models/test_moe_models.py tests/kernels/test_moe_small.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$R/gpu_tests.log" | tail -5
