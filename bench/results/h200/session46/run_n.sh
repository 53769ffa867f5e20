#!/usr/bin/env bash
# Planned in session 46 for the next session (its device time was spent; one H200, ~6 min): two levers of the small
# MoE path (kernels/moe_small_triton.py), both off by default until this measures them --
#   HYBRIDSERVE_MOE_EARLY_SHARED=1  the up kernel's shared-expert programs launch first and compute before the
#                                   router wait (they run while the router logits kernel does);
#   HYBRIDSERVE_MOE_PREFETCH=1      the up and down kernels issue each weight tile's load one K block ahead (two tiles
#                                   in flight per program: these GEMVs are bound by each program's load latency).
# Their CUDA tests, then the 30B-A3B batch-1 decode step (bench/step_profile.py, one CUDA graph) for plain / early /
# prefetch / both, two rounds in rotation. Make the winners the default (early_shared_enabled, prefetch_enabled)
# and record the step in bench/results/h200/decode_step_b1/README.md.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_small.py -k cuda > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$R/gpu_tests.log"
for round in 1 2; do
  for variant in "0 0" "1 0" "0 1" "1 1"; do
    read -r early prefetch <<< "$variant"
    name="step_30b_early${early}_prefetch${prefetch}_r$round"
    HYBRIDSERVE_MOE_EARLY_SHARED=$early HYBRIDSERVE_MOE_PREFETCH=$prefetch timeout 70 python3 -u \
      bench/step_profile.py --config bench/configs/nemotron-3-nano-30b-a3b.json --out "$R/$name.json" > "$R/$name.log" 2>&1
    echo "$name rc=$?"; grep -E "replay|_small_" "$R/$name.log" | head -3
  done
done
