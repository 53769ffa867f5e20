#!/usr/bin/env bash
# Session 47, call 4 (one H200): programmatic dependent launch with each kernel letting its successor launch before
# it waits (P: `pdl_gate` triggers, then waits; the router logits kernel keeps wait-then-trigger, since the up
# kernel's early shared programs read x before their gate), and P with the skinny linear prefetching 2048 instead of
# 1024 columns of its rows into L2 before its gate (Q), against this tree (A). P / Q's files are carried in
# .whl/ab/<tree>/kernels and overlaid on a copy of the package in /tmp/ab<tree>. Every run saves its first replay's
# logits; the last step compares them with A's.
set -uo pipefail
R=$1; mkdir -p "$R"
for t in P Q; do
  T=/tmp/ab$t/hybridserve; rm -rf "/tmp/ab$t"; mkdir -p "$T/models"
  cp hybridserve/*.py "$T/"; cp -r kernels "$T/kernels"; cp models/*.py "$T/models/"
  ln -s "$PWD/models/demo_model" "$T/models/demo_model"
  for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do ln -s "$PWD/$d" "$T/$d"; done
  cp .whl/ab/$t/kernels/*.py "$T/kernels/"
done
printf 'import hybridserve.kernels.triton_utils as m, inspect\nprint("overlay:", m.__file__, "pdl_wait_then_launch" in inspect.getsource(m))\n' > /tmp/probe.py
PYTHONPATH=/tmp/abQ:$PYTHONPATH python3 /tmp/probe.py  # a script, not -c: the cwd's hybridserve/ would come first
step() {  # name, tree (A / P / Q), config
  local name=$1 tree=$2 cfg=$3 pp=$PYTHONPATH
  if [ "$tree" != A ]; then pp=/tmp/ab$tree:$PYTHONPATH; fi
  env PYTHONPATH="$pp" timeout 100 python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$R/$name.json" --save-logits "/tmp/logits_$name.pt" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay" "$R/$name.log" | head -1
}
for round in 1 2; do
  for t in A P Q; do step "30b_${t}$round" $t nemotron-3-nano-30b-a3b.json; done
done
step 9b_A1 A nemotron-nano-9b-v2.json
step 9b_P1 P nemotron-nano-9b-v2.json
python3 - "$R" <<'PY' | tee "$R/logits_check.txt"
import glob, sys, torch
for ref_name in ("30b_A1", "9b_A1"):
    ref = torch.load(f"/tmp/logits_{ref_name}.pt")
    for path in sorted(glob.glob(f"/tmp/logits_{ref_name[:3]}*.pt")):
        x = torch.load(path)
        print(path, "max |diff| vs", ref_name, float((x - ref).abs().max()), "argmax equal", bool(torch.equal(x.argmax(-1), ref.argmax(-1))))
PY
