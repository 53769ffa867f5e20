#!/usr/bin/env bash
# Session 51, call 4 (one H200): the attention layer at batch 1 (paged decode 8.8 + combine 2.1 + write_kv 1.5 us
# per layer against ~1 us of KV bytes). S: KV splits of >= 64 keys instead of 128 (at 512 keys of context: 9
# splits of one 64-key tile instead of 5 of two); SPD: S + the three attention kernels launched under PDL (their
# programs resident early, waiting at the gate) + a CTA barrier before the skinny split-K count (as the MoE down
# kernel has). A (the tree: 5a2c913) / S / SPD alternating, two rounds; logits vs A's.
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
ab_tree S; ab_tree SPD
for round in 1 2; do
  for t in A S SPD; do ab_step "30b_$t$round" $t nemotron-3-nano-30b-a3b.json "$R" 110; done
done
ab_logits 30b_A1 | tee "$R/logits_check.txt"
