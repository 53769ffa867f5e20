#!/usr/bin/env bash
# Prepared in session 51, not run (the session's device time was spent): the fused decode conv + state update
# (`conv_state_update.patch`, tested under the interpreter: the two kernels' bits, windows and states; the
# interpreted engine's tests pass) against the tree without it, then its GPU tests.
# Before the call, in the repository root:
#   git apply bench/results/h200/session51/conv_state_update.patch
#   mkdir -p .whl/ab/O/kernels .whl/ab/O/models
#   for f in kernels/ops.py kernels/state_update.py models/mamba_mixer.py; do git show HEAD:$f > .whl/ab/O/$f; done
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session51/run_next_conv_state.sh $OUT/x
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O
for round in 1 2; do
  for t in O A; do ab_step "30b_$t$round" $t nemotron-3-nano-30b-a3b.json "$R" 110; done
done
ab_logits 30b_O1 | tee "$R/logits_check.txt"
timeout 150 python -m pytest -q -m gpu tests/kernels/test_conv_state_update.py tests/kernels/test_moe.py -k "cuda or hopper" \
  > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
