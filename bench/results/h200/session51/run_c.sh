#!/usr/bin/env bash
# Session 51, call 3 (one H200): call 2's pending-norm tree (A, 2.50 ms) lost inside the MoE layer: the down kernel
# (+3.4 us) now lets the in_proj's programs launch at its gate and wait resident (before: one add_rmsnorm program),
# and the early shared up programs normalise their own input (+3.9 us). B: the down kernel triggers its successor
# at the end of its work; C: B + no early shared programs under a pending input (bench/prenorm.py: 54.6 vs 56.6 us).
# O (5a2c913) / B / C alternating, two rounds; logits vs O's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O; ab_tree B; ab_tree C
for round in 1 2; do
  for t in O B C; do ab_step "30b_$t$round" $t nemotron-3-nano-30b-a3b.json "$R" 110; done
done
ab_logits 30b_O1 | tee "$R/logits_check.txt"
