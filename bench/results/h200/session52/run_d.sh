#!/usr/bin/env bash
# Call 5 of session 52: bench/chain_floor.py with its variants (programs per SM, whole-run L2 prefetch) and the copy
# bandwidth measured as bench/moe.py does; the real 30B step beside it.
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session52/run_d.sh $OUT/call5
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
for cfg in nemotron-3-nano-30b-a3b nemotron-nano-9b-v2; do
  timeout 150 python3 -u bench/chain_floor.py --config "bench/configs/$cfg.json" --out "$R/chain_$cfg.json" \
    > "$R/chain_$cfg.log" 2>&1
  echo "chain $cfg rc=$?"; grep -v -i warn "$R/chain_$cfg.log"
done
ab_step 30b_A A nemotron-3-nano-30b-a3b.json "$R" 120
