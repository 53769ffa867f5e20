#!/usr/bin/env bash
# Session 43, call a: the offline engine replaying the served 1024/64 at 8 req/s workload, prefix caching off then
# on (same process, one engine after the other), heap frozen after start-up as a worker does: is a cache-on
# decode step slower in the engine alone, and in which phase?
set -x
OUT=$1; mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
cd bench && timeout 330 python3 engine_trace.py --rate 8 --num-prompts 160 --input-len 1024 --output-len 64 \
  --gc-freeze --caching off,on --out "$OUT/trace" > "$OUT/trace.log" 2>&1
echo "rc=$?" >> "$OUT/trace.log"
