#!/usr/bin/env bash
# Session 49, call 4 (one H200): deeper software pipelines for the tiled skinny projection. Tree B (carried in
# .whl/ab/B/kernels) lets the autotuner also pick 5 and 6 stages (A: 3 and 4). 30B-A3B batch-1 step A / B
# alternating, two rounds; the 9B step once each; logits against A's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree B
ab_step 30b_A1 A nemotron-3-nano-30b-a3b.json "$R" 150
ab_step 30b_B1 B nemotron-3-nano-30b-a3b.json "$R" 160
ab_step 30b_A2 A nemotron-3-nano-30b-a3b.json "$R" 80
ab_step 30b_B2 B nemotron-3-nano-30b-a3b.json "$R" 80
ab_step 9b_A1 A nemotron-nano-9b-v2.json "$R" 100
ab_step 9b_B1 B nemotron-nano-9b-v2.json "$R" 110
ab_logits 30b_A1 | tee "$R/logits_check.txt"
ab_logits 9b_A1 | tee -a "$R/logits_check.txt"
