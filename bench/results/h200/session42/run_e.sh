#!/usr/bin/env bash
# Session 42, call E (one H200), diagnostic with an uncommitted patch: the router does not subscribe to cache events
# (router/workers.py); prefix cache on vs off served, drift-balanced, as call D.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"; git diff router >> "$R/commit.txt"
ABBA=1 ROUNDS=2 NUM_PROMPTS=160 timeout 440 bash bench/serve_cache_ab.sh "$R/cache_ab" > "$R/cache_ab.log" 2>&1
echo "ab rc=$?"; tail -30 "$R/cache_ab.log"
