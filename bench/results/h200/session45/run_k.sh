#!/usr/bin/env bash
# Planned in session 45 for the next session (one H200, ~6 min): served prefix cache off vs on at the commit where the
# engine loop files cache events while its forwards compute (no poller thread; the cache-on launch phase was +0.09 ms
# at equal GPU wait in call h), ABBA over 2 rounds x 2 passes, 1024/64 at 8 req/s, then the offline batch-4 step.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu" ROUNDS=2 ABBA=1 NUM_PROMPTS=120 \
  timeout 380 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -40 "$R/ab.log"
(cd bench && timeout 70 python3 one_batch.py --batch 4 --input-len 1024 --output-len 64 --repeats 3 \
  --json "$R/one_batch_4x1024.json" > "$R/one_batch.log" 2>&1)
echo "one_batch rc=$?"; grep -A6 '"decode_phase_ms_p50"' "$R/one_batch_4x1024.json" | tail -7
