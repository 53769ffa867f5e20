#!/usr/bin/env bash
# Prepared in session 51, not run (the session's device time was spent): two levers for the 30B-A3B batch-1 step,
# both interpreter-tested, neither measured:
#   conv_state_update.patch  the Mamba decode conv update folded into the state update (one launch fewer per layer)
#   moe_split_up.patch       (applies after the first) the MoE up step as two launches: shared slots (FMA, while the
#                            router runs), then the routed slots through a pipelined tl.dot loop
# Trees: O = the tree before both, S = the split up only, A = both. Before the call, in the repository root:
#   mkdir -p .whl/ab/O/kernels .whl/ab/O/models .whl/ab/S/kernels .whl/ab/S/models
#   for f in kernels/ops.py kernels/state_update.py kernels/moe_small_triton.py models/mamba_mixer.py; do
#     git show HEAD:$f > .whl/ab/O/$f; git show HEAD:$f > .whl/ab/S/$f; done
#   git apply bench/results/h200/session51/conv_state_update.patch
#   git apply bench/results/h200/session51/moe_split_up.patch
#   cp kernels/moe_small_triton.py .whl/ab/S/kernels/
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session51/run_next.sh $OUT/x
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O; ab_tree S
ab_rounds 2 "O S A" nemotron-3-nano-30b-a3b.json "$R" 110
ab_logits 30b_O1 | tee "$R/logits_check.txt"
timeout 170 python -m pytest -q -m gpu tests/kernels/test_conv_state_update.py tests/kernels/test_moe_small.py \
  tests/kernels/test_moe.py -k "cuda or hopper" > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
