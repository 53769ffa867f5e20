#!/usr/bin/env bash
# Session 49, call 5 (one H200): the skinny projection's autotuner timing configs as the decode graph runs them
# (call5_cold_graph_autotune.patch, carried as tree B in .whl/ab/B/kernels: a CUDA graph of [128 MB L2 flush,
# kernel] x 10 minus the flushes) instead of Triton's single-launch events. 30B-A3B batch-1 step A / B alternating,
# two rounds; logits against A's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree B
ab_step 30b_A1 A nemotron-3-nano-30b-a3b.json "$R" 130
ab_step 30b_B1 B nemotron-3-nano-30b-a3b.json "$R" 130
ab_step 30b_A2 A nemotron-3-nano-30b-a3b.json "$R" 60
ab_step 30b_B2 B nemotron-3-nano-30b-a3b.json "$R" 60
ab_logits 30b_A1 | tee "$R/logits_check.txt"
