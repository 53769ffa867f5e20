#!/usr/bin/env bash
# Session 49, call 1 (one H200): decode weights read into L2 on a side stream (kernels/l2_prefetch.py).
# HYBRIDSERVE_L2_PREFETCH=0: off (the tree before); 1: Mamba out_proj + attention o_proj after in_proj / q/k/v;
# 2: also the MoE shared expert's up rows after the norm before the router. 30B-A3B batch-1 step, levels
# alternating, two rounds; the prefetch micro-benchmark; the 9B step off / on; logits against level 0's; GPU tests.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
run_step() {  # name, level, config, seconds
  export HYBRIDSERVE_L2_PREFETCH=$2
  ab_step "$1" A "$3" "$R" "$4"
}
run_step 30b_L0_1 0 nemotron-3-nano-30b-a3b.json 170
run_step 30b_L1_1 1 nemotron-3-nano-30b-a3b.json 90
run_step 30b_L2_1 2 nemotron-3-nano-30b-a3b.json 90
run_step 30b_L0_2 0 nemotron-3-nano-30b-a3b.json 90
run_step 30b_L1_2 1 nemotron-3-nano-30b-a3b.json 90
run_step 30b_L2_2 2 nemotron-3-nano-30b-a3b.json 90
unset HYBRIDSERVE_L2_PREFETCH
timeout 90 python3 -u bench/l2_prefetch.py --out "$R/l2_prefetch.json" > "$R/l2_prefetch.log" 2>&1
echo "l2_prefetch rc=$?"; tail -40 "$R/l2_prefetch.log"
run_step 9b_L0_1 0 nemotron-nano-9b-v2.json 120
run_step 9b_L1_1 1 nemotron-nano-9b-v2.json 90
unset HYBRIDSERVE_L2_PREFETCH
ab_logits 30b_L0_1 | tee "$R/logits_check.txt"
ab_logits 9b_L0_1 | tee -a "$R/logits_check.txt"
left=$((545 - SECONDS))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -q -m gpu tests/kernels/test_l2_prefetch.py > "$R/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -5 "$R/gpu_tests.log"
fi
