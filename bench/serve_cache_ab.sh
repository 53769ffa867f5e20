#!/usr/bin/env bash
# Prefix cache on vs off on unique prompts, served, as an A/B that alternates the servers ROUNDS times
# (off, on, off, on, ...; ABBA=1 reverses the order every second round), so drift of the machine (clocks, other
# load) hits them alike. Each round starts a fresh server of each setting and runs PASSES over it (default "a b":
# two passes of the same arrival pattern with fresh token ids). GPU clocks and power are logged (nvidia-smi, once
# a second) beside it. VARIANTS (default "colocated-1gpu-nocache colocated-1gpu") names the bench/serve_gpu.sh
# deployments compared, e.g. add colocated-1gpu-fewckpt (the cache with the cache-off memory layout).
#
#   bash bench/serve_cache_ab.sh OUT            # ROUNDS=2 WORKLOADS=1024:64 RATES=8 NUM_PROMPTS=160
#
# OUT/ab_summary.json holds TTFT / TPOT / ITL p50 and p99 and the worker's mean step and decode-only step per
# (deployment, round, pass) and the medians per deployment; OUT/ab_raw.tar.gz the per-run JSON and server logs;
# OUT/gpu_clocks.csv the clock log.
set -euo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu/cache_ab}")
mkdir -p "$OUT"
export ROUNDS=${ROUNDS:-2} WORKLOADS=${WORKLOADS:-1024:64} RATES=${RATES:-8} NUM_PROMPTS=${NUM_PROMPTS:-160}
export PASSES=${PASSES:-"a b"}
read -r -a variants <<< "${VARIANTS:-colocated-1gpu-nocache colocated-1gpu}"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -l 1 > "$OUT/gpu_clocks.csv" 2>/dev/null &
clock_pid=$!
raw=${RAW_DIR:-$(mktemp -d)}  # RAW_DIR keeps the per-run files where a cut-off run leaves them
mkdir -p "$raw"
for round in $(seq 1 "$ROUNDS"); do
  order=("${variants[@]}")
  if [ "${ABBA:-0}" = 1 ] && [ $((round % 2)) = 0 ]; then
    order=(); for ((i=${#variants[@]}-1; i>=0; i--)); do order+=("${variants[$i]}"); done
  fi
  for deployment in "${order[@]}"; do
    bash bench/serve_gpu.sh "$raw/r$round" "$deployment" > "$raw/r$round-$deployment.log" 2>&1 || true
  done
done
kill "$clock_pid" 2>/dev/null || true
python3 - "$raw" "$OUT/ab_summary.json" "${variants[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path

from hybridserve.engine.step_timing import PHASES

raw, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
setting_of = {"colocated-1gpu-nocache": "off", "colocated-1gpu": "on"}

rows = []
for path in sorted(raw.glob("r*/*-rate*.json")):
    metrics = json.loads(path.read_text())["metrics"]
    name = path.stem  # DEPLOYMENT-IN-OUT-PASS-rateR
    deployment = max((v for v in variants if name.startswith(v + "-")), key=len, default=None)
    if deployment is None:
        continue
    rows.append({
        "setting": setting_of.get(deployment, deployment), "round": path.parent.name, "run": name,
        "completed": metrics["completed"], "failed": metrics["failed"],
        **{f"{m}_{q}": round(metrics[f"{m}_ms"][q], 3) for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")},
        "step_ms": metrics.get("engine_step_ms_mean"), "gap_ms": metrics.get("engine_gap_ms_mean"),
        "decode_step_ms": metrics.get("engine_decode_step_ms_mean"),
        "decode_rows": metrics.get("engine_decode_rows_mean"),
        "eager_decode_steps": metrics.get("engine_eager_decode_steps"),
        **{f"decode_{phase}_ms": ms for phase, ms in (metrics.get("engine_decode_phase_ms_mean") or {}).items()},
        "gc_ms_per_s": sum((metrics.get("gc_pause_ms_per_s") or {}).values()) if metrics.get("gc_pause_ms_per_s") else None,
        "gc2_ms_per_s": (metrics.get("gc_pause_ms_per_s") or {}).get("2"),
    })
summary = {}
for setting in dict.fromkeys(r["setting"] for r in rows):
    mine = [r for r in rows if r["setting"] == setting]
    if mine:
        summary[setting] = {k: round(statistics.median(r[k] for r in mine), 3)
                            for k in ("ttft_p50", "tpot_p50", "itl_p50", "ttft_p99", "tpot_p99", "step_ms", "gap_ms",
                                      "decode_step_ms", "decode_rows", *(f"decode_{p}_ms" for p in PHASES),
                                      "gc_ms_per_s", "gc2_ms_per_s")
                            if all(r.get(k) is not None for r in mine)}
for setting in [s for s in summary if s != "off"]:
    if "off" in summary:
        summary[f"{setting}_over_off"] = {k: round(summary[setting][k] / summary["off"][k], 4) for k in summary[setting]
                                          if k in summary["off"] and summary["off"][k]}
out.write_text(json.dumps({"runs": rows, "median_over_runs": summary}, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
tar czf "$OUT/ab_raw.tar.gz" -C "$raw" .
