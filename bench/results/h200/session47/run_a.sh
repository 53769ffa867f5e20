#!/usr/bin/env bash
# Session 47, call 2 (one H200): this session's tree (B) against the session's start (A = c692a8b, whose two changed
# files -- kernels/moe_small_triton.py, models/attention.py -- are carried in .whl/ab and overlaid on a copy of the
# package in /tmp/ab, which PYTHONPATH puts before the editable install). B's changes: the MoE up kernel's shared
# programs early by default, the down kernel's per-lane K sums (one reduction after the loop), q/k/v as one weight.
set -uo pipefail
R=$1; mkdir -p "$R"
A=/tmp/ab/hybridserve; rm -rf /tmp/ab; mkdir -p "$A/models"
cp hybridserve/*.py "$A/"; cp -r kernels "$A/kernels"; cp models/*.py "$A/models/"
ln -s "$PWD/models/demo_model" "$A/models/demo_model"
for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$A/$d"; done
cp .whl/ab/moe_small_triton.py "$A/kernels/"; cp .whl/ab/attention.py "$A/models/"
printf 'import hybridserve.kernels.moe_small_triton as m, inspect\nprint("A overlay:", m.__file__, "acc3" in inspect.getsource(m))\n' > /tmp/probe.py
PYTHONPATH=/tmp/ab:$PYTHONPATH python3 /tmp/probe.py  # a script, not -c: the cwd's hybridserve/ would come first
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_small.py tests/models/test_attention_qkv.py -k "cuda or qkv" > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$R/gpu_tests.log"
step() {  # name, extra env..., then the config
  local name=$1 tree=$2 cfg=$3; shift 3
  if [ "$tree" = A ]; then pp=/tmp/ab:$PYTHONPATH; else pp=$PYTHONPATH; fi
  env PYTHONPATH="$pp" "$@" timeout 100 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay|_small_|_skinny" "$R/$name.log" | head -4
}
step 30b_B1 B nemotron-3-nano-30b-a3b.json
step 30b_A1 A nemotron-3-nano-30b-a3b.json
step 30b_B2 B nemotron-3-nano-30b-a3b.json
step 30b_A2 A nemotron-3-nano-30b-a3b.json
step 30b_Bnoearly B nemotron-3-nano-30b-a3b.json HYBRIDSERVE_MOE_EARLY_SHARED=0
step 9b_B B nemotron-nano-9b-v2.json
step 9b_A A nemotron-nano-9b-v2.json
timeout 120 python3 -u bench/moe.py --device cuda --skip fp8_decode fp8_prefill prefill --out "$R/moe_B.json" > "$R/moe_B.log" 2>&1
echo "moe rc=$?"; tail -15 "$R/moe_B.log"
