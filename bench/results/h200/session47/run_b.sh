#!/usr/bin/env bash
# Session 47, call 3 (one H200): the small MoE down kernel slot by slot, each step a [BLOCK_N, BLOCK_K up to 2048]
# tile of one expert's whole-row runs (B, this tree), against the slots side by side in [8, BLOCK_N, 128-256] tiles
# (A: kernels/moe_small_triton.py of 70f1e21, carried in .whl/ab with this tree's models/attention.py and overlaid
# on a copy of the package in /tmp/ab). Then bench/moe.py (the MoE layer at 1-128 tokens and the step) for B.
set -uo pipefail
R=$1; mkdir -p "$R"
A=/tmp/ab/hybridserve; rm -rf /tmp/ab; mkdir -p "$A/models"
cp hybridserve/*.py "$A/"; cp -r kernels "$A/kernels"; cp models/*.py "$A/models/"
ln -s "$PWD/models/demo_model" "$A/models/demo_model"
for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$A/$d"; done
cp .whl/ab/moe_small_triton.py "$A/kernels/"; cp .whl/ab/attention.py "$A/models/"
printf 'import hybridserve.kernels.moe_small_triton as m, inspect\nprint("A overlay:", m.__file__, "static_range" in inspect.getsource(m))\n' > /tmp/probe.py
PYTHONPATH=/tmp/ab:$PYTHONPATH python3 /tmp/probe.py  # a script, not -c: the cwd's hybridserve/ would come first
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_small.py -k cuda > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$R/gpu_tests.log"
step() {  # name, tree (A / B), config, then extra env
  local name=$1 tree=$2 cfg=$3; shift 3
  if [ "$tree" = A ]; then pp=/tmp/ab:$PYTHONPATH; else pp=$PYTHONPATH; fi
  env PYTHONPATH="$pp" "$@" timeout 100 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay|_small_" "$R/$name.log" | head -3
}
for round in 1 2; do
  step "30b_B$round" B nemotron-3-nano-30b-a3b.json
  step "30b_A$round" A nemotron-3-nano-30b-a3b.json
done
timeout 150 python3 -u bench/moe.py --device cuda --skip fp8_decode fp8_prefill prefill --out "$R/moe_B.json" > "$R/moe_B.log" 2>&1
echo "moe rc=$?"; grep -E "^\|| over |small_configs|step batch" "$R/moe_B.log" | head -14
python3 -c "import json; print(json.load(open('$R/moe_B.json'))['small_configs'])"
