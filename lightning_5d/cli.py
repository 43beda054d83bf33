"""The ``l5d`` command.

``l5d train [overrides] [-m ...]`` hands everything after ``train`` to the Hydra app in
:mod:`lightning_5d.train`; Hydra's own flags (``--help``, ``--cfg job``, ``-m``,
``--config-dir``) work there. ``l5d estimate`` and ``l5d plan`` are argparse commands
from :mod:`lightning_5d.estimate.cli`, and ``l5d schedule`` (draw a pipeline schedule) is
from :mod:`lightning_5d.pipeline_view`; both are imported only when the parser is built,
so ``train`` works without them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

TRAIN_HELP = "run a recipe (Hydra app): l5d train recipe=<name> parallel.zero=3 devices=2 ..."
TRAIN_EPILOG = (
    "Everything after `train` goes to Hydra: key=value overrides, group choices\n"
    "(recipe=tiny_zero3, parallel=hsdp, precision=bf16_mixed), -m for sweeps,\n"
    "--cfg job to print the composed config, --help for the config groups,\n"
    "--dry-run to count each rank's start-up bytes against its GPU (starts nothing)."
)


def _unavailable(name: str, error: BaseException):
    def func(args: argparse.Namespace) -> int:
        print(f"l5d {name} is not available: {error}", file=sys.stderr)
        return 1

    return func


def build_parser() -> argparse.ArgumentParser:
    from lightning_5d import __version__

    parser = argparse.ArgumentParser(
        prog="l5d",
        description="lightning_5d: 5D-parallel training for LightningModules, recipes and a planner.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `l5d train --help` for the recipe runner's config groups.",
    )
    parser.add_argument("--version", action="version", version=f"lightning_5d {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,estimate,plan,schedule,export}")
    sub.add_parser(
        "train",
        help=TRAIN_HELP,
        description=TRAIN_HELP,
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    try:
        from lightning_5d.estimate import cli as estimate_cli
    except ImportError as err:
        for name, text in (("estimate", "predict memory/FLOPs/communication"), ("plan", "search layouts")):
            p = sub.add_parser(name, help=f"{text} (unavailable: {err})")
            p.set_defaults(func=_unavailable(name, err))
    else:
        estimate_cli.register(sub)
    try:
        from lightning_5d import pipeline_view
    except ImportError as err:
        p = sub.add_parser("schedule", help=f"draw a pipeline schedule (unavailable: {err})")
        p.set_defaults(func=_unavailable("schedule", err))
    else:
        pipeline_view.register(sub)
    try:
        from lightning_5d.checkpoint import export as export_cli
    except ImportError as err:
        p = sub.add_parser("export", help=f"consolidate a checkpoint (unavailable: {err})")
        p.set_defaults(func=_unavailable("export", err))
    else:
        export_cli.register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        from lightning_5d.train import main as train_main

        return train_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
