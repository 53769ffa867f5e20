#!/usr/bin/env bash
# mypy on the library. The packages live in top-level folders that pyproject.toml maps to hybridserve.*
# (setuptools package-dir), which mypy cannot follow, so the check runs over a link tree of that mapping.
# The packages listed in [tool.mypy] "packages" are checked (more join as they are made clean).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/hybridserve"
cp hybridserve/*.py "$tree/hybridserve/"
for d in common kernels models engine statepool prefill_worker decode_worker router deploy proto transfer worker_runtime; do
  ln -s "$PWD/$d" "$tree/hybridserve/$d"
done
packages=$(python - <<'PY'
import pathlib, tomllib
args = []
for p in tomllib.load(open("pyproject.toml", "rb"))["tool"]["mypy"]["packages"]:
    if p == "hybridserve":  # the root package's own files (the CLI), not the whole tree under it
        args += [f"-m hybridserve.{f.stem}" if f.stem != "__init__" else "-m hybridserve"
                 for f in sorted(pathlib.Path("hybridserve").glob("*.py"))]
    else:
        args.append(f"-p hybridserve.{p}")
print(" ".join(args))
PY
)
# shellcheck disable=SC2086
(cd "$tree" && python -m mypy --config-file "$OLDPWD/pyproject.toml" $packages)
