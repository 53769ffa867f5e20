#!/usr/bin/env bash
# Session 48, call 4 (one H200): this session's tree as committed (the small MoE up kernel lets the down kernel
# launch at the end of its work) -- the MoE layer at 1-128 tokens and the step (bench/moe.py), the 30B-A3B batch-1
# step twice (bench/step_profile.py), then the CUDA tests of the small MoE path and the MoE models.
set -uo pipefail
R=$1; mkdir -p "$R"
timeout 150 python3 -u bench/moe.py --device cuda --skip fp8_decode fp8_prefill prefill --out "$R/moe.json" > "$R/moe.log" 2>&1
echo "moe rc=$?"; grep -E "^\|| = " "$R/moe.log" | head -10
for round in 1 2; do
  timeout 90 python3 -u bench/step_profile.py --config bench/configs/nemotron-3-nano-30b-a3b.json \
    --out "$R/30b_$round.json" > "$R/30b_$round.log" 2>&1
  echo "30b_$round rc=$?"; grep replay "$R/30b_$round.log"
done
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_small.py \
  tests/models/test_moe_models.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$R/gpu_tests.log" | tail -5
