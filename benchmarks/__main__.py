"""`python -m benchmarks run [--quick] [--only NAME ...]`: run, then write RESULTS.md and results.json."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks import memory_vs_theory

BENCHMARKS = {"memory_vs_theory": memory_vs_theory}
HERE = Path(__file__).parent


def machine() -> str:
    import torch

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), default=sorted(BENCHMARKS))
    args = parser.parse_args(argv)
    results = json.loads((HERE / "results.json").read_text()) if (HERE / "results.json").exists() else {}
    for name in args.only:
        print(f"[benchmarks] {name} ...", flush=True)
        result = BENCHMARKS[name].run(args.quick)
        result["date"] = dt.date.today().isoformat()
        result["machine"] = machine()
        result["markdown"] = BENCHMARKS[name].markdown(result)
        results[name] = result
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    sections = ["# Benchmark results", "", "Written by `python -m benchmarks run`; numbers are ratios measured side by side in one run.", ""]
    for name, result in sorted(results.items()):
        sections += [f"## {name}", "", f"- command: `{result['command']}`", f"- machine: {result['machine']}",
                     f"- date: {result['date']}", "", result["markdown"], ""]  # fmt: skip
    (HERE / "RESULTS.md").write_text("\n".join(sections))
    print((HERE / "RESULTS.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
