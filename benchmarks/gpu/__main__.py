"""``python -m benchmarks.gpu prepare | run | merge``: the one-GPU suite (benchmarks/README.md).

    python -m benchmarks.gpu prepare                   # here: the wheels the GPU machine lacks -> .gpu_wheels/
    bash benchmarks/gpu/device_run.sh "$OUT"           # there: install them, run every part -> $OUT/gpu.{json,md}
    python -m benchmarks.gpu run --out DIR --dry       # any machine: every part on CPU, tiny model, seconds
    python -m benchmarks.gpu merge DIR/gpu.json        # back here: into results.json and RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks.gpu import fp8_speed, suite, wheels


def _recipes(text: str) -> tuple[str, ...]:
    from lightning_5d.fp8 import Fp8Recipe

    names = tuple(r.strip() for r in text.split(",") if r.strip())
    valid = [r.value for r in Fp8Recipe]
    bad = [r for r in names if r not in valid]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown FP8 recipe(s) {bad}; choose from {valid}, comma separated")
    return names


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be an integer >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="download/build the wheels the GPU machine lacks (run where pip has network)")
    prep.add_argument("--wheels", default=wheels.DEFAULT_DIR, help=f"folder for them (default {wheels.DEFAULT_DIR})")
    run = sub.add_parser("run", help="measure every part; write gpu.json and gpu.md into --out")
    run.add_argument("--out", required=True, type=Path, help="folder for gpu.json, gpu.md, model_config.json")
    run.add_argument("--dry", action="store_true", help="CPU, tiny model, tiny sizes: checks the script in seconds")
    run.add_argument("--budget-s", type=_positive, default=suite.DEFAULT_BUDGET_S, help="seconds for all parts")
    run.add_argument("--only", nargs="+", choices=list(suite.PARTS), default=list(suite.PARTS))
    run.add_argument("--peak-tflops", type=_positive, default=None, help="dense bf16 peak (default: by card name)")
    run.add_argument("--seq", type=_positive_int, default=None, help="sequence length (default 2048; dry 32)")
    run.add_argument("--batch", type=_positive_int, default=None, help="sequences per step (default 4; dry 2)")
    run.add_argument("--fp8-recipes", type=_recipes, default=fp8_speed.DEFAULT_RECIPES,
                     help=f"comma separated (default {','.join(fp8_speed.DEFAULT_RECIPES)})")  # fmt: skip
    merge = sub.add_parser("merge", help="put a run's gpu.json into benchmarks/results.json and RESULTS.md")
    merge.add_argument("result", type=Path, help="the gpu.json a run wrote")
    merge.add_argument("--into", type=Path, default=None, help="folder of results.json (default: benchmarks/)")
    return p


def merge(result: Path, into: Path | None = None) -> list[Path]:
    """The run's JSON becomes the ``gpu`` entry of ``results.json``; ``RESULTS.md`` is rendered again."""
    from benchmarks.__main__ import HERE, render

    folder = into or HERE
    results_path = folder / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results[suite.NAME] = json.loads(result.read_text())
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    (folder / "RESULTS.md").write_text(render(results))
    return [results_path, folder / "RESULTS.md"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "prepare":
        try:
            made = wheels.prepare(Path(args.wheels))
        except wheels.PrepareError as err:
            print(f"prepare: error: {err}", file=sys.stderr)
            return 2
        print("\n".join(str(w) for w in made))
        print(f"carry {args.wheels} to the GPU machine; there: bash benchmarks/gpu/device_run.sh \"$OUT\"")
        return 0
    if args.command == "merge":
        written = merge(args.result, args.into)
        print(f"merged {args.result} into {' and '.join(str(p) for p in written)}")
        return 0
    base = suite.DRY if args.dry else suite.FULL
    sizes = base.replace(seq=args.seq or base.seq, batch=args.batch or base.batch)
    try:
        result = suite.run_suite(
            args.out, dry=args.dry, command="python -m benchmarks.gpu " + shlex.join(argv),
            budget_s=args.budget_s, only=tuple(args.only), sizes=sizes, peak_tflops=args.peak_tflops,
            fp8_recipes=args.fp8_recipes,
        )  # fmt: skip
    except suite.NoGpuError as err:
        print(f"run: error: {err}", file=sys.stderr)
        return 2
    print(result["markdown"])
    failed = [name for name, part in result["parts"].items() if "error" in part]
    print(f"\nwrote {args.out / suite.JSON_FILE} and {args.out / suite.MARKDOWN_FILE}"
          + (f"; parts that failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
