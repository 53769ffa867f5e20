#!/usr/bin/env bash
# Session 51, call 1 (one H200): the PendingNorm input (residual add + next RMSNorm inside the next block's first
# kernels) against the tree before it (O = 5a2c913's kernels/models): 30B-A3B batch-1 step, alternating, two
# rounds; logits vs O's; then the GPU tests of the fused kernels.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O
for round in 1 2; do
  for t in O A; do ab_step "30b_$t$round" $t nemotron-3-nano-30b-a3b.json "$R" 110; done
done
ab_logits 30b_O1 | tee "$R/logits_check.txt"
timeout 170 python -m pytest -q -m gpu tests/kernels/test_skinny_linear_triton.py tests/kernels/test_moe_small.py -k "pending or graph" \
  > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
