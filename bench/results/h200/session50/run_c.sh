#!/usr/bin/env bash
# Session 50, call 3 (one H200): the one-launch layer with its registers capped (tree D: every config also with
# maxnreg 128 at 4 warps / 64 at 8, so 4 programs fit an SM as in the three-launch down kernel; two smaller tiles).
# The MoE layer at 1 token under A and D, then the 30B-A3B batch-1 step: three launches, D, two rounds.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree D
for t in A D; do
  path=${PYTHONPATH:-}; if [ $t != A ]; then path="/tmp/ab$t:$path"; fi
  env PYTHONPATH="$path" timeout 150 python bench/moe.py --device cuda --skip prefill fp8_decode fp8_prefill step \
    --decode-tokens 1 --out "$R/moe_$t.json" > "$R/moe_$t.log" 2>&1
  echo "moe $t rc=$?"; grep -E "^\| 1 " "$R/moe_$t.log"; grep -o '"one_launch": {[^}]*}' "$R/moe_$t.json" | cut -c1-400
done
for round in 1 2; do
  export HYBRIDSERVE_MOE_ONE_LAUNCH=0; ab_step "30b_three$round" A nemotron-3-nano-30b-a3b.json "$R" 120
  export HYBRIDSERVE_MOE_ONE_LAUNCH=1; ab_step "30b_D$round" D nemotron-3-nano-30b-a3b.json "$R" 120
done
ab_logits 30b_three1 | tee "$R/logits_check.txt"
