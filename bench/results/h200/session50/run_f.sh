#!/usr/bin/env bash
# Session 50, call 6 (one H200): call 5's pipelined tl.dot kernels gained 5 us per MoE layer alone but ~1 us in the
# step (down -3 us, up +1.8). Tree H: the FMA up kernel (64ec193's) with the pipelined down kernel. The MoE layer at
# 1 token under H; the 30B-A3B batch-1 step O / A / H alternating, two rounds; logits vs O's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree O; ab_tree H
env PYTHONPATH="/tmp/abH:${PYTHONPATH:-}" timeout 100 python bench/moe.py --device cuda \
  --skip prefill fp8_decode fp8_prefill step --decode-tokens 1 --out "$R/moe_H.json" > "$R/moe_H.log" 2>&1
echo "moe H rc=$?"; grep -E "^\| 1 " "$R/moe_H.log"
for round in 1 2; do
  for t in O A H; do ab_step "30b_$t$round" $t nemotron-3-nano-30b-a3b.json "$R" 90; done
done
ab_logits 30b_O1 | tee "$R/logits_check.txt"
