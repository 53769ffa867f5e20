#!/usr/bin/env bash
# Session 50, call 1 (one H200): the one-launch MoE layer (kernels/moe_decode_triton.py). GPU tests; the 30B-A3B
# batch-1 step with three launches per MoE layer (HYBRIDSERVE_MOE_ONE_LAUNCH=0) and one (=1), alternating, two
# rounds, logits against the first; the MoE layer at 1 and 2 tokens through every path.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
timeout 120 python -m pytest -q -m gpu tests/kernels/test_moe_decode.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
export HYBRIDSERVE_MOE_ONE_LAUNCH=0; ab_step 30b_three1 A nemotron-3-nano-30b-a3b.json "$R" 140
export HYBRIDSERVE_MOE_ONE_LAUNCH=1; ab_step 30b_one1 A nemotron-3-nano-30b-a3b.json "$R" 120
export HYBRIDSERVE_MOE_ONE_LAUNCH=0; ab_step 30b_three2 A nemotron-3-nano-30b-a3b.json "$R" 60
export HYBRIDSERVE_MOE_ONE_LAUNCH=1; ab_step 30b_one2 A nemotron-3-nano-30b-a3b.json "$R" 60
unset HYBRIDSERVE_MOE_ONE_LAUNCH
ab_logits 30b_three1 | tee "$R/logits_check.txt"
timeout 150 python bench/moe.py --device cuda --skip prefill fp8_decode fp8_prefill step --decode-tokens 1 2 \
  --out "$R/moe_decode.json" > "$R/moe_decode.log" 2>&1
echo "moe rc=$?"; tail -8 "$R/moe_decode.log"
