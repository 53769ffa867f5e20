#!/usr/bin/env bash
# Session 48, call 1 (one H200): the Mamba decode projections with their neighbours folded in (B: this tree,
# in_proj + conv update and gated RMSNorm + out_proj, kernels/mamba_proj_triton.py) against the tree before (A:
# 995d301's mixer, layers and skinny kernel, carried in .whl/ab/A and overlaid on a copy of the package in /tmp/abA).
# 30B-A3B batch-1 step twice each, alternating, and 9B once each; every run saves its first replay's logits and the
# last step compares B's with A's. Then the CUDA tests of the new kernels and the skinny kernel.
set -uo pipefail
R=$1; mkdir -p "$R"
T=/tmp/abA/hybridserve; rm -rf /tmp/abA; mkdir -p "$T/models"
cp hybridserve/*.py "$T/"; cp -r kernels "$T/kernels"; cp models/*.py "$T/models/"
ln -s "$PWD/models/demo_model" "$T/models/demo_model"
for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$T/$d"; done
cp .whl/ab/A/kernels/*.py "$T/kernels/"; cp .whl/ab/A/models/*.py "$T/models/"
printf 'import hybridserve.models.mamba_mixer as m, inspect\nprint("overlay:", m.__file__, "in_proj_conv" in inspect.getsource(m))\n' > /tmp/probe.py
PYTHONPATH=/tmp/abA:$PYTHONPATH python3 /tmp/probe.py  # a script, not -c: the cwd's hybridserve/ would come first
step() {  # name, tree (A / B), config
  local name=$1 tree=$2 cfg=$3 pp=$PYTHONPATH
  if [ "$tree" = A ]; then pp=/tmp/abA:$PYTHONPATH; fi
  env PYTHONPATH="$pp" timeout 120 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" --save-logits "/tmp/logits_$name.pt" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay" "$R/$name.log" | head -1
}
for round in 1 2; do
  for t in A B; do step "30b_${t}$round" $t nemotron-3-nano-30b-a3b.json; done
done
step 9b_A1 A nemotron-nano-9b-v2.json
step 9b_B1 B nemotron-nano-9b-v2.json
python3 - "$R" <<'PY' | tee "$R/logits_check.txt"
import glob, sys, torch
for ref_name in ("30b_A1", "9b_A1"):
    ref = torch.load(f"/tmp/logits_{ref_name}.pt").float()
    for path in sorted(glob.glob(f"/tmp/logits_{ref_name[:3]}*.pt")):
        x = torch.load(path).float()
        print(path, "max |diff| vs", ref_name, float((x - ref).abs().max()), "ref max |x|", float(ref.abs().max()),
              "argmax equal", bool(torch.equal(x.argmax(-1), ref.argmax(-1))))
PY
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mamba_proj_triton.py \
  tests/kernels/test_skinny_linear_triton.py > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error" "$R/gpu_tests.log" | tail -8
