#!/usr/bin/env bash
# Session 48, call 2 (one H200): where programmatic dependent launch lets the next kernel launch. A: this tree
# (every PDL kernel waits, then triggers its successor, at the gate); C: no explicit trigger anywhere (the next kernel
# launches as the programs exit); D: the big streaming kernels (skinny linear, small MoE up / down, state update)
# trigger at the end of their work, the small ones at the gate as in A. C / D's files are carried in
# .whl/ab/<tree>/kernels and overlaid on a copy of the package in /tmp/ab<tree>. 30B-A3B batch-1 step, two rounds,
# alternating; every run saves its first replay's logits, compared with A's at the end.
set -uo pipefail
R=$1; mkdir -p "$R"
for t in C D; do
  T=/tmp/ab$t/hybridserve; rm -rf "/tmp/ab$t"; mkdir -p "$T/models"
  cp hybridserve/*.py "$T/"; cp -r kernels "$T/kernels"; cp models/*.py "$T/models/"
  ln -s "$PWD/models/demo_model" "$T/models/demo_model"
  for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$T/$d"; done
  cp .whl/ab/$t/kernels/*.py "$T/kernels/"
done
printf 'import hybridserve.kernels.triton_utils as m, inspect\nprint("overlay:", m.__file__, "pdl_trigger" in inspect.getsource(m))\n' > /tmp/probe.py
PYTHONPATH=/tmp/abD:$PYTHONPATH python3 /tmp/probe.py  # a script, not -c: the cwd's hybridserve/ would come first
step() {  # name, tree (A / C / D), config
  local name=$1 tree=$2 cfg=$3 pp=$PYTHONPATH
  if [ "$tree" != A ]; then pp=/tmp/ab$tree:$PYTHONPATH; fi
  env PYTHONPATH="$pp" timeout 150 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" --save-logits "/tmp/logits_$name.pt" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay" "$R/$name.log" | head -1
}
for round in 1 2; do
  for t in A C D; do step "30b_${t}$round" $t nemotron-3-nano-30b-a3b.json; done
done
python3 - "$R" <<'PY' | tee "$R/logits_check.txt"
import glob, torch
ref = torch.load("/tmp/logits_30b_A1.pt").float()
for path in sorted(glob.glob("/tmp/logits_30b*.pt")):
    x = torch.load(path).float()
    print(path, "max |diff| vs 30b_A1", float((x - ref).abs().max()))
PY
