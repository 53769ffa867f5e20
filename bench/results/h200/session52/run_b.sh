#!/usr/bin/env bash
# Call 3 of session 52: out_proj / o_proj load a slice of their weight into registers before their gate.
# Trees (bench/step_ab.sh): O = before (889f1dd's kernels and models); A = the working tree: state update, gated
# norm, paged decode and split combine trigger before they wait (tree R of call 2), and the warm-weight projections
# (out_proj, o_proj) load PRELOAD_ELEMENTS = 8192 weight elements per program before the gate; Q = A with 4096.
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session52/run_b.sh $OUT/call3
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O; ab_tree Q
ab_rounds 2 "O A Q" nemotron-3-nano-30b-a3b.json "$R" 100
ab_logits 30b_O1 | tee "$R/logits_check.txt"
timeout 120 python -m pytest -q -m gpu tests/kernels/test_skinny_linear_triton.py -k split_k \
  > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
