#!/usr/bin/env bash
# The GPU machine's side of the suite (no network there): install the carried wheels and the project,
# then run every part. Usage, from the repository root: bash benchmarks/gpu/device_run.sh OUT_DIR [run options]
# The wheels come from `python -m benchmarks.gpu prepare` (folder .gpu_wheels, or $WHEELS).
set -uo pipefail
out="${1:?usage: bash benchmarks/gpu/device_run.sh OUT_DIR [options of python -m benchmarks.gpu run]}"
shift
wheels="${WHEELS:-.gpu_wheels}"
mkdir -p "$out"
shopt -s nullglob
carried=("$wheels"/*.whl)
if [ "${#carried[@]}" -eq 0 ]; then
  echo "no wheels in $wheels: run 'python -m benchmarks.gpu prepare' before, and carry $wheels" >&2
  exit 2
fi
# By name==version, not by file: the folder holds pydantic-core once per CPython 3.10-3.13, and pip
# picks the one this interpreter matches (installing the files themselves would fail on the other three).
mapfile -t wanted < <(for w in "${carried[@]}"; do base="${w##*/}"; IFS=- read -r name version _ <<<"$base";
  echo "$name==$version"; done | sort -u)
python -m pip install --no-index --find-links "$wheels" --no-deps "${wanted[@]}" >"$out/install.log" 2>&1 || {
  tail -20 "$out/install.log" >&2; exit 2; }
# The project itself; the suite imports it from this tree either way (python -m runs in the repo root).
python -m pip install --no-index --no-deps --no-build-isolation -e . >>"$out/install.log" 2>&1 ||
  echo "note: installing the project failed (see $out/install.log); running from the source tree" >&2
exec python -m benchmarks.gpu run --out "$out" "$@"
