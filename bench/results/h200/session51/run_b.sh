#!/usr/bin/env bash
# Session 51, call 2 (one H200): call 1's pending-norm tree lost (30B step 2.38 -> 3.70 ms: the skinny projection
# normalising its 16 padded rows took 4-5x its time). Now with the one-row path (the add and norm on [BLOCK_K]
# vectors, s^2 reduced after the loop): bench/prenorm.py (each consumer unfused / pending / bare) and the step.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
timeout 240 python bench/prenorm.py --out "$R/prenorm.json" > "$R/prenorm.log" 2>&1
echo "prenorm rc=$?"; cat "$R/prenorm.log" | grep consumer
ab_step 30b_A1 A nemotron-3-nano-30b-a3b.json "$R" 110
