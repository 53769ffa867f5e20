#!/usr/bin/env bash
# A/B of two server settings, served on the CPU (router + one decode worker as processes, no Ray), alternating
# A, B, B, A, ... for ROUNDS rounds so drift of the machine hits both alike. The default compares the router's
# session with its decode worker (A) against a gRPC call per request (B, --no-worker-sessions) on a tiny
# random NemotronH checkpoint (steps of ~ms, so per-token transport costs show), many short streams at once.
#
#   bash bench/serve_ab_cpu.sh OUT      # ROUNDS=4 A_FLAGS="" B_FLAGS="--no-worker-sessions"
#   PREFILL_WORKERS=1 bash bench/serve_ab_cpu.sh OUT   # disaggregated: 1 prefill + 1 decode worker
#
# OUT/ab_summary.json: TTFT / TPOT / ITL p50, output tokens/s, the engine's mean step and gap between steps
# (its own metrics: the offline-engine line the served TPOT is compared with), and the decode worker's and the
# router's CPU seconds per run (from /proc), with medians per setting; OUT/<setting>-r<round>-*.json the
# serve.py results.
set -euo pipefail
OUT=$(realpath -m "${1:-bench/results/cpu/serve_ab}")
mkdir -p "$OUT"
ROUNDS=${ROUNDS:-4}
A_FLAGS=${A_FLAGS:-}
B_FLAGS=${B_FLAGS:---no-worker-sessions}
LOAD=(--workload random --input-len ${INPUT_LEN:-32} --output-len ${OUTPUT_LEN:-64} --num-prompts ${NUM_PROMPTS:-96}
      --request-rate ${RATE:-inf} --max-concurrency ${CONCURRENCY:-32} --token-range 3,300)
MODEL=$(python3 - <<'PY'
import sys
sys.path[:0] = ["tests/router", "tests"]
from router_cluster import tiny_model_dir
print(tiny_model_dir())
PY
)
COMMON=(--no-ray --model "$MODEL" --prefill-workers ${PREFILL_WORKERS:-0} --decode-workers 1 --max-num-seqs 32 --max-model-len 256
        --port 8000 --grpc-port 50051 --insecure-internal)

cpu_of() {  # user+system seconds of every process whose command line has $1 (children of the server)
  python3 - "$1" <<'PY'
import os, sys
total = 0.0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        if sys.argv[1] in cmd and "python3 -" not in cmd:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        pass
print(round(total, 2))
PY
}

run() {  # setting name, round, flags
  local name=$1 round=$2 flags=$3
  # shellcheck disable=SC2086
  hybridserve serve "${COMMON[@]}" $flags --log-dir "$OUT/logs-$name-r$round" > "$OUT/$name-r$round.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 180); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)" 2>/dev/null && break
    sleep 1
  done
  python3 bench/serve.py --base-url http://127.0.0.1:8000 "${LOAD[@]}" --result-dir "$OUT" --result-name warm-$name-r$round \
    > /dev/null 2>&1 || true  # warm-up pass: connections, first shapes
  local w0 r0
  w0=$(cpu_of "worker --role decode"); r0=$(cpu_of "$MODEL --prefill-workers")
  python3 bench/serve.py --base-url http://127.0.0.1:8000 "${LOAD[@]}" --result-dir "$OUT" --result-name "$name-r$round" \
    > "$OUT/$name-r$round.bench.log" 2>&1 || true
  echo "{\"setting\": \"$name\", \"round\": $round, \"worker_cpu_s\": $(python3 -c "print(round($(cpu_of "worker --role decode") - $w0, 2))"), \"router_cpu_s\": $(python3 -c "print(round($(cpu_of "$MODEL --prefill-workers") - $r0, 2))")}" >> "$OUT/cpu.jsonl"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 2
}

rm -f "$OUT/cpu.jsonl" "$OUT"/warm-*.json
# the offline engine on one batch of the served size: its decode step is the line the served TPOT is held to
python3 bench/one_batch.py --model "$MODEL" --batch "${CONCURRENCY:-32}" --input-len "${INPUT_LEN:-32}" \
  --output-len "${OUTPUT_LEN:-64}" --max-num-seqs 32 --max-model-len 256 --repeats 3 --json "$OUT/offline.json" > /dev/null
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then run A "$round" "$A_FLAGS"; run B "$round" "$B_FLAGS"
  else run B "$round" "$B_FLAGS"; run A "$round" "$A_FLAGS"; fi
done
rm -f "$OUT"/warm-*
python3 - "$OUT" "$A_FLAGS" "$B_FLAGS" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
cpu = {(r["setting"], r["round"]): r for r in map(json.loads, (out / "cpu.jsonl").read_text().splitlines())}
rows = []
for path in sorted(out.glob("[AB]-r*-rate*.json")):
    setting, rnd = path.stem.split("-")[0], int(path.stem.split("-")[1][1:])
    m = json.loads(path.read_text())["metrics"]
    rows.append({"setting": setting, "round": rnd, "completed": m["completed"], "failed": m["failed"],
                 "output_tok_s": round(m.get("output_throughput", 0.0), 1),
                 **{f"{k}_p50": round(m[f"{k}_ms"]["p50"], 3) for k in ("ttft", "tpot", "itl")},
                 "step_ms": m.get("engine_step_ms_mean"), "gap_ms": m.get("engine_gap_ms_mean"),
                 "outputs_per_step": m.get("engine_outputs_per_step"),
                 **{k: cpu.get((setting, rnd), {}).get(k) for k in ("worker_cpu_s", "router_cpu_s")}})
keys = ("ttft_p50", "tpot_p50", "itl_p50", "output_tok_s", "step_ms", "gap_ms", "outputs_per_step", "worker_cpu_s",
        "router_cpu_s")
summary = {s: {k: statistics.median(r[k] for r in rows if r["setting"] == s) for k in keys
               if all(r[k] is not None for r in rows if r["setting"] == s)} for s in ("A", "B")}
offline = json.loads((out / "offline.json").read_text())
result = {"A_flags": sys.argv[2], "B_flags": sys.argv[3], "median": summary,
          "offline_decode_step_ms_p50": round(offline["decode_step_ms_p50"], 3), "offline_batch": offline["batch"],
          "runs": rows}
(out / "ab_summary.json").write_text(json.dumps(result, indent=1))
print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
PY
