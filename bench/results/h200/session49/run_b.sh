#!/usr/bin/env bash
# Session 49, call 2 (one H200): every skinny-projection config on the 30B-A3B decode shapes, weight cold and warm
# in L2 (bench/skinny_configs.py), and whether a side-stream L2 prefetch during 8 us of idle lands in time.
set -uo pipefail
R=$1; mkdir -p "$R"
timeout 420 python3 -u bench/skinny_configs.py --out "$R/skinny_configs.json" > "$R/skinny_configs.log" 2>&1
echo "skinny_configs rc=$?"; cat "$R/skinny_configs.log" | tail -40
