#!/usr/bin/env bash
# Session 50, call 4 (one H200): the one-launch layer's down programs send DN_LINES x 64 columns of each slot's
# rows to L2 before waiting on the up programs; at 16 (tree A) that is up to ~50 MB issued while the up programs
# stream. Trees E (no prefetch) and F (2 lines). The MoE layer at 1 token under A, E, F; the 30B-A3B batch-1 step:
# three launches, E, F, two rounds.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree E; ab_tree F
for t in A E F; do
  path=${PYTHONPATH:-}; if [ $t != A ]; then path="/tmp/ab$t:$path"; fi
  env PYTHONPATH="$path" timeout 120 python bench/moe.py --device cuda --skip prefill fp8_decode fp8_prefill step \
    --decode-tokens 1 --out "$R/moe_$t.json" > "$R/moe_$t.log" 2>&1
  echo "moe $t rc=$?"; grep -E "^\| 1 " "$R/moe_$t.log"
done
for round in 1 2; do
  export HYBRIDSERVE_MOE_ONE_LAUNCH=0; ab_step "30b_three$round" A nemotron-3-nano-30b-a3b.json "$R" 120
  export HYBRIDSERVE_MOE_ONE_LAUNCH=1
  ab_step "30b_E$round" E nemotron-3-nano-30b-a3b.json "$R" 90
  ab_step "30b_F$round" F nemotron-3-nano-30b-a3b.json "$R" 90
done
ab_logits 30b_three1 | tee "$R/logits_check.txt"
