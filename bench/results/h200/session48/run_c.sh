#!/usr/bin/env bash
# Session 48, call 3 (one H200): where the big kernels let their successors launch. A: this tree (every PDL kernel
# triggers its successor at its gate); D: the skinny linear, small MoE up / down and state update trigger at the end
# of their work (call 2's D); E: only the small MoE up kernel does (the down kernel launches when the up kernel's
# programs are done). D / E's files are carried in .whl/ab/<tree>/kernels. 30B-A3B batch-1 step, two rounds,
# alternating, 9B once for A and D; logits compared with A's at the end; then bench/moe.py's MoE layer on D.
set -uo pipefail
R=$1; mkdir -p "$R"
for t in D E; do
  T=/tmp/ab$t/hybridserve; rm -rf "/tmp/ab$t"; mkdir -p "$T/models"
  cp hybridserve/*.py "$T/"; cp -r kernels "$T/kernels"; cp models/*.py "$T/models/"
  ln -s "$PWD/models/demo_model" "$T/models/demo_model"
  for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$T/$d"; done
  cp .whl/ab/$t/kernels/*.py "$T/kernels/"
done
step() {  # name, tree (A / D / E), config
  local name=$1 tree=$2 cfg=$3 pp=$PYTHONPATH
  if [ "$tree" != A ]; then pp=/tmp/ab$tree:$PYTHONPATH; fi
  env PYTHONPATH="$pp" timeout 150 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" --save-logits "/tmp/logits_$name.pt" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay" "$R/$name.log" | head -1
}
for round in 1 2; do
  for t in A D E; do step "30b_${t}$round" $t nemotron-3-nano-30b-a3b.json; done
done
step 9b_A1 A nemotron-nano-9b-v2.json
step 9b_D1 D nemotron-nano-9b-v2.json
python3 - "$R" <<'PY' | tee "$R/logits_check.txt"
import glob, torch
for ref_name in ("30b_A1", "9b_A1"):
    ref = torch.load(f"/tmp/logits_{ref_name}.pt").float()
    for path in sorted(glob.glob(f"/tmp/logits_{ref_name[:3]}*.pt")):
        print(path, "max |diff| vs", ref_name, float((torch.load(path).float() - ref).abs().max()))
PY
printf 'import runpy, sys\nsys.argv = ["bench/moe.py"] + sys.argv[1:]\nrunpy.run_path("bench/moe.py", run_name="__main__")\n' > /tmp/moe_run.py
PYTHONPATH=/tmp/abD:$PYTHONPATH timeout 150 python3 -u /tmp/moe_run.py --device cuda --skip fp8_decode fp8_prefill \
  prefill --out "$R/moe_D.json" > "$R/moe_D.log" 2>&1
echo "moe D rc=$?"; grep -E "^\|| = " "$R/moe_D.log" | head -12
