#!/usr/bin/env bash
# Call 1 of session 52: small kernels before out_proj / o_proj release it first, it warms its weight in L2.
# Trees (bench/step_ab.sh): O = before (889f1dd's kernels and models), R = release-first only (state update, gated
# norm, paged decode, split combine trigger before they wait; out_proj / o_proj prefetch 1024 columns per row as
# before), A = the working tree (R + out_proj / o_proj prefetch up to half the L2 of their weight),
# C = A + the conv update also releasing first (out_proj resident from the end of in_proj).
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session52/run_a.sh $OUT/call2
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O; ab_tree R; ab_tree C
ab_rounds 2 "O R A C" nemotron-3-nano-30b-a3b.json "$R" 100
ab_logits 30b_O1 | tee "$R/logits_check.txt"
for t in O A; do ab_step "9b_$t" $t nemotron-nano-9b-v2.json "$R" 100; done
ab_logits 9b_O | tee -a "$R/logits_check.txt"
timeout 110 python -m pytest -q -m gpu -x tests/kernels/test_skinny_linear_triton.py tests/kernels/test_state_update_triton.py \
  tests/kernels/test_paged_attention_decode.py tests/kernels/test_conv_norm_triton.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
