#!/usr/bin/env bash
# Call 4 of session 52: the best a kernel-per-op chain can do (bench/chain_floor.py) beside the real step, one lease.
# Command: source .whl/setup.sh; export TRITON_CACHE_DIR=/tmp/tc; bash bench/results/h200/session52/run_c.sh $OUT/call4
set -uo pipefail
R=$1; mkdir -p "$R"
source bench/step_ab.sh
for cfg in nemotron-3-nano-30b-a3b nemotron-nano-9b-v2; do
  timeout 150 python3 -u bench/chain_floor.py --config "bench/configs/$cfg.json" --out "$R/chain_$cfg.json" \
    > "$R/chain_$cfg.log" 2>&1
  echo "chain $cfg rc=$?"; cat "$R/chain_$cfg.log" | grep -v -i warn
done
ab_step 30b_A A nemotron-3-nano-30b-a3b.json "$R" 120
ab_step 9b_A A nemotron-nano-9b-v2.json "$R" 120
