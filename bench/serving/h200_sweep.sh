#!/usr/bin/env bash
# The throughput sweep on one GPU, each model shape behind its own server (bench/serving/throughput.py).
#
#   bash bench/serving/h200_sweep.sh OUT [ROW ...]
#
# ROW is one of the rows below (default: 9b-256 30b-fp8-512); each row is `label config fp8 concurrencies waves
# server-flags` (waves: prompts per point over its concurrency; WAVES overrides it). BUDGET (seconds, default
# 540) stops starting new points once spent; EXTRA adds server flags to every row (e.g.
# EXTRA="--kv-cache-dtype fp8 --mamba-ssm-cache-dtype bfloat16").
set -uo pipefail
OUT=${1:?usage: h200_sweep.sh OUT [ROW ...]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${BUDGET:-540}
START=$(date +%s)
CFG=bench/configs
declare -A ROWS=(
  [9b-256]="nano9b $CFG/nemotron-nano-9b-v2.json 0 256 2 --max-num-seqs 256 --max-model-len 4096"
  [9b-sweep]="nano9b $CFG/nemotron-nano-9b-v2.json 0 64,256,512,1024 2 --max-num-seqs 1024 --max-model-len 4096"
  [9b-8k]="nano9b-8k $CFG/nemotron-nano-9b-v2.json 0 64,256 2 --max-num-seqs 256 --max-model-len 10240"
  [30b-fp8-512]="30b-fp8 $CFG/nemotron-3-nano-30b-a3b.json 1 512 1 --max-num-seqs 512 --gpu-memory-gb 60 --max-model-len 4096"
  [30b-fp8-1024]="30b-fp8 $CFG/nemotron-3-nano-30b-a3b.json 1 1024 2 --max-num-seqs 1024 --max-model-len 4096"
  [30b-fp8-sweep]="30b-fp8 $CFG/nemotron-3-nano-30b-a3b.json 1 64,256,512,1024 2 --max-num-seqs 1024 --max-model-len 4096"
  [30b-bf16-sweep]="30b-bf16 $CFG/nemotron-3-nano-30b-a3b.json 0 64,256,512,1024 2 --max-num-seqs 1024 --max-model-len 4096"
  [30b-bf16-1024]="30b-bf16 $CFG/nemotron-3-nano-30b-a3b.json 0 1024 2 --max-num-seqs 1024 --max-model-len 4096"
)
# the memory plan at one budget: --max-num-seqs 64 .. 1,024 at --gpu-memory-gb 40, 512 prompts at 512 in flight,
# 1,024 in / 256 out (rows 9b-mem64 .. 9b-mem1024; prefill graphs off in every row to shorten the server's start)
for seqs in 64 128 256 512 1024; do
  ROWS[9b-mem$seqs]="nano9b-mem$seqs $CFG/nemotron-nano-9b-v2.json 0 512 1 --max-num-seqs $seqs --gpu-memory-gb 40 \
--max-model-len 4096 --no-prefill-cuda-graphs"
done
[ "$#" -eq 0 ] && set -- 9b-256 30b-fp8-512
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.csv" 2>/dev/null || true
child=
trap '[ -n "$child" ] && kill "$child" 2>/dev/null; wait; exit 143' TERM INT  # the client stops its server
for row in "$@"; do
  spec=${ROWS[$row]:-}
  [ -z "$spec" ] && { echo "unknown row $row (rows: ${!ROWS[*]})" >&2; continue; }
  read -r label config fp8 levels per flags <<< "$spec"
  left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 60 ]; then echo "skipped $row: budget spent" | tee -a "$OUT/skipped.txt"; continue; fi
  fp8_flag=(); [ "$fp8" = 1 ] && fp8_flag=(--fp8)
  per=${WAVES:-$per}
  input=1024; [[ $row == *-8k ]] && input=8192
  output=1024; [[ $row == 9b-mem* ]] && output=256
  python3 bench/serving/throughput.py --config "$config" "${fp8_flag[@]}" --label "$label" --concurrency "$levels" \
    --input-len "$input" --output-len "$output" \
    --waves "$per" --time-budget "$(( left - 60 ))" --out "$OUT" -- $flags ${EXTRA:-} >> "$OUT/$label.client.log" 2>&1 &
  child=$!
  wait "$child"
  child=
  tail -n 2 "$OUT/$label.client.log"
done
cat "$OUT/table.md" 2>/dev/null
