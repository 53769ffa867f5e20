#!/usr/bin/env bash
# A/B of decode-step variants in one GPU lease: source this from a per-call script run in the repository root.
#   ab_tree X            copy of the package in /tmp/abX with tree X's files (.whl/ab/X/{kernels,models}/*.py,
#                        carried with .whl) laid over it; tree A is the working tree itself
#   ab_step NAME X CFG DIR [SECONDS]
#                        bench/step_profile.py on bench/configs/CFG under tree X -> DIR/NAME.{json,log}, its first
#                        replay's logits in /tmp/logits_NAME.pt; prints the replay line
#   ab_rounds N "X Y .." CFG DIR [SECONDS]
#                        N rounds of ab_step over the trees in order (NAME = CFG's model tag, tree, round)
#   ab_logits REF        every /tmp/logits_<REF's first 3 characters>*.pt against /tmp/logits_REF.pt (max |diff|)
# Scripts, not `python -c`: the cwd's hybridserve/ would come before PYTHONPATH's overlay.

ab_tree() {
  local tree=$1 root=/tmp/ab$1/hybridserve d
  rm -rf "/tmp/ab$tree"; mkdir -p "$root/models"
  cp hybridserve/*.py "$root/"; cp -r kernels "$root/kernels"; cp models/*.py "$root/models/"
  ln -s "$PWD/models/demo_model" "$root/models/demo_model"
  for d in engine statepool prefill_worker decode_worker router deploy transfer worker_runtime proto; do
    ln -s "$PWD/$d" "$root/$d"
  done
  for d in kernels models; do
    if compgen -G ".whl/ab/$tree/$d/*.py" > /dev/null; then cp ".whl/ab/$tree/$d/"*.py "$root/$d/"; fi
  done
  printf 'import hybridserve\nprint("tree %s:", hybridserve.__file__)\n' "$tree" > "/tmp/ab_probe_$tree.py"
  PYTHONPATH="/tmp/ab$tree:${PYTHONPATH:-}" python3 "/tmp/ab_probe_$tree.py"
}

ab_step() {
  local name=$1 tree=$2 cfg=$3 dir=$4 limit=${5:-150} path=${PYTHONPATH:-}
  if [ "$tree" != A ]; then path="/tmp/ab$tree:$path"; fi
  env PYTHONPATH="$path" timeout "$limit" python3 -u bench/step_profile.py --config "bench/configs/$cfg" \
    --out "$dir/$name.json" --save-logits "/tmp/logits_$name.pt" > "$dir/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "replay" "$dir/$name.log" | head -1
}

ab_rounds() {
  local rounds=$1 trees=$2 cfg=$3 dir=$4 limit=${5:-150} round t tag
  tag=$(case "$cfg" in *30b*) echo 30b ;; *9b*) echo 9b ;; *) echo step ;; esac)
  for round in $(seq 1 "$rounds"); do
    for t in $trees; do ab_step "${tag}_$t$round" "$t" "$cfg" "$dir" "$limit"; done
  done
}

ab_logits() {
  python3 - "$1" <<'PY'
import glob, sys, torch
ref_name = sys.argv[1]
ref = torch.load(f"/tmp/logits_{ref_name}.pt").float()
for path in sorted(glob.glob(f"/tmp/logits_{ref_name[:3]}*.pt")):
    print(path, "max |diff| vs", ref_name, float((torch.load(path).float() - ref).abs().max()))
PY
}
