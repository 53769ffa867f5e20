#!/usr/bin/env bash
# Session 51, call 5 (one H200): the committed attention change (31ddc9e): its GPU tests (paged decode / verify /
# prefill attention, skinny split-K with the new barrier, MoE small path graph replays), then the 9B step
# O (5a2c913's two kernel files) vs A (the tree), one round each.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
timeout 200 python -m pytest -q -m gpu tests/kernels/test_paged_attention_decode.py tests/kernels/test_paged_attention_triton.py \
  tests/kernels/test_skinny_linear_triton.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
ab_tree O
for t in O A; do ab_step "9b_$t" $t nemotron-nano-9b-v2.json "$R" 100; done
ab_logits 9b_O | tee "$R/logits_check.txt"
