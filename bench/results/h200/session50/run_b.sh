#!/usr/bin/env bash
# Session 50, call 2 (one H200): where call 1's one-launch layer loses. Trees (bench/step_ab.sh): A = the tree
# (program roles from a ticket counter), B = roles from the program id (the hardware's dispatch order), C = B plus
# a nanosleep in the waits and smaller tiles in the autotune space. The MoE layer at 1 token under A, B, C (each
# run also times three launches), then the 30B-A3B batch-1 step: three launches (A, HYBRIDSERVE_MOE_ONE_LAUNCH=0),
# B, C, two rounds.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree B; ab_tree C
for t in A B C; do
  path=${PYTHONPATH:-}; if [ $t != A ]; then path="/tmp/ab$t:$path"; fi
  env PYTHONPATH="$path" timeout 120 python bench/moe.py --device cuda --skip prefill fp8_decode fp8_prefill step \
    --decode-tokens 1 --out "$R/moe_$t.json" > "$R/moe_$t.log" 2>&1
  echo "moe $t rc=$?"; grep -E "^\| 1 " "$R/moe_$t.log"
done
for round in 1 2; do
  export HYBRIDSERVE_MOE_ONE_LAUNCH=0; ab_step "30b_three$round" A nemotron-3-nano-30b-a3b.json "$R" 120
  export HYBRIDSERVE_MOE_ONE_LAUNCH=1
  ab_step "30b_B$round" B nemotron-3-nano-30b-a3b.json "$R" 90
  ab_step "30b_C$round" C nemotron-3-nano-30b-a3b.json "$R" 90
done
ab_logits 30b_three1 | tee "$R/logits_check.txt"
