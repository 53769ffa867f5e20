#!/usr/bin/env bash
# Session 50, call 5 (one H200): the small MoE kernels' GEMVs as software-pipelined tl.dot loops (tree A: the
# working tree; down one program per (column tile, slot), the last arrival adds the slots) against the
# FMA kernels they replace (tree O: 64ec193's kernels/moe_small_triton.py, carried in .whl/ab/O). GPU tests; the MoE
# layer at 1 and 2 tokens under O and A; the 30B-A3B batch-1 step O / A alternating, two rounds; logits vs O's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O
timeout 150 python -m pytest -q -m gpu tests/kernels/test_moe_small.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$R/gpu_tests.log"
for t in O A; do
  path=${PYTHONPATH:-}; if [ $t != A ]; then path="/tmp/ab$t:$path"; fi
  env PYTHONPATH="$path" timeout 120 python bench/moe.py --device cuda --skip prefill fp8_decode fp8_prefill step \
    --decode-tokens 1 2 --out "$R/moe_$t.json" > "$R/moe_$t.log" 2>&1
  echo "moe $t rc=$?"; grep -E "^\| [12] " "$R/moe_$t.log"
done
for round in 1 2; do
  ab_step "30b_O$round" O nemotron-3-nano-30b-a3b.json "$R" 100
  ab_step "30b_A$round" A nemotron-3-nano-30b-a3b.json "$R" 100
done
ab_logits 30b_O1 | tee "$R/logits_check.txt"
