#!/usr/bin/env bash
# Session 42, call D (one H200): prefix cache on vs off on unique prompts, served, drift-balanced
# (rounds off-on | on-off, a fresh server each, two passes each), then decode graphs exact vs padded buckets.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
ABBA=1 ROUNDS=2 NUM_PROMPTS=160 timeout 430 bash bench/serve_cache_ab.sh "$R/cache_ab" > "$R/cache_ab.log" 2>&1
echo "ab rc=$?"; tail -30 "$R/cache_ab.log"
(cd bench && timeout 140 python3 decode_buckets.py --batches 3 5 6 7 --steps 20 --rounds 2 \
  --out "$R/decode_buckets.json" > "$R/decode_buckets.log" 2>&1)
echo "buckets rc=$?"; grep "^{'batch" "$R/decode_buckets.log"
