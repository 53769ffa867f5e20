#!/usr/bin/env bash
# Session 49, call 3 (one H200): stream-K skinny projections (kernels/skinny_streamk_triton.py) against the tiled
# split-K kernel, HYBRIDSERVE_SKINNY_STREAMK=0 / 1 alternating: 30B-A3B batch-1 step two rounds, 9B once each;
# logits against the tiled kernel's; the GPU tests of the skinny kernels; then every config of both kernels cold /
# warm in L2 (bench/skinny_configs.py) in the time left.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
run_step() {  # name, stream-K on, config, seconds
  export HYBRIDSERVE_SKINNY_STREAMK=$2
  ab_step "$1" A "$3" "$R" "$4"
}
run_step 30b_S0_1 0 nemotron-3-nano-30b-a3b.json 150
run_step 30b_S1_1 1 nemotron-3-nano-30b-a3b.json 150
run_step 30b_S0_2 0 nemotron-3-nano-30b-a3b.json 80
run_step 30b_S1_2 1 nemotron-3-nano-30b-a3b.json 80
run_step 9b_S0_1 0 nemotron-nano-9b-v2.json 100
run_step 9b_S1_1 1 nemotron-nano-9b-v2.json 100
unset HYBRIDSERVE_SKINNY_STREAMK
ab_logits 30b_S0_1 | tee "$R/logits_check.txt"
ab_logits 9b_S0_1 | tee -a "$R/logits_check.txt"
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_skinny_linear_triton.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -5 "$R/gpu_tests.log"
left=$((560 - SECONDS))
timeout "$left" python3 -u bench/skinny_configs.py --out "$R/skinny_configs.json" > "$R/skinny_configs.log" 2>&1
echo "skinny_configs rc=$?"; tail -30 "$R/skinny_configs.log"
