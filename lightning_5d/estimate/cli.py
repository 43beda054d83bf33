"""`l5d estimate` and `l5d plan`: argparse subcommands the top-level `l5d` CLI registers.

l5d estimate --model llama3-70b --tp 8 --pp 4 --dp 4 --zero 1 --seq 4096 --mbs 1 --json
l5d plan --model llama3-8b --gpus 64 --gpu-mem 80 --gpus-per-node 8
l5d estimate --recipe llama3_70b_64gpu [parallel.pp=8 ...]   # an `l5d train` recipe's exact layout
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from typing import Any

from lightning_5d.config import ActivationCheckpointing, ContextParallelMode, LayoutError, PipelineSchedule
from lightning_5d.layout_rules import Rule

from .estimator import estimate
from .recipe_check import check_recipe_name
from .report import estimate_json, format_estimate, format_plan, plan_json
from .search import ALL_DIMS, plan, refused_text
from .spec import PRESETS, ModelSpecError, load_spec
from .timing import DEFAULT_PEAK_TFLOPS, Cluster
from .training import AttentionKernel, Precision, StateAccounting, TrainingSetup

DEFAULT_SEQ_LEN = 4096  # the playbook's usual training length; long-context runs say --seq
DEFAULT_BATCH_TOKENS = 4 * 2**20  # ~4M tokens per step, the playbook's typical LLM global batch


def _choices(enum_cls) -> list[str]:
    return [m.value for m in enum_cls]


def _add_common(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument(
        "--model", required=model_required, help=f"preset ({', '.join(sorted(PRESETS))}) or path to a HF config.json"
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length s (default: 4096, or the model's max_seq_len if shorter)",
    )
    p.add_argument("--precision", choices=_choices(Precision), default=Precision.BF16.value)
    p.add_argument("--fp32-grad-accum", action="store_true", help="keep an fp32 gradient accumulator (+4 bytes/param)")
    p.add_argument(
        "--state-accounting",
        choices=_choices(StateAccounting),
        default=StateAccounting.RUNTIME.value,
        help="runtime: the fp32 master gradients lightning_5d holds (default); paper: the ZeRO paper's bytes",
    )
    p.add_argument(
        "--attention",
        choices=_choices(AttentionKernel),
        default=AttentionKernel.FLASH.value,
        help="flash: no s x s scores kept; eager: scores kept for backward",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="decides which groups cross nodes (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON with stable keys instead of a table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write a chart (needs matplotlib: pip install 'lightning-5d[plot]')",
    )


def register(subparsers: Any) -> None:
    """Add the `estimate` and `plan` subcommands to an argparse subparsers object."""
    est = subparsers.add_parser(
        "estimate",
        help="predict memory / FLOPs / comm / bubble for one layout",
        description="Predict params, FLOPs, per-GPU memory, communication and "
        "pipeline bubble for one layout. Formulas: docs/planner.md.",
    )
    _add_common(est, model_required=False)
    recipe = est.add_argument_group("recipe (instead of --model and the flags below)")
    recipe.add_argument(
        "--recipe",
        help="an `l5d train` recipe (recipes/NAME.yaml): its model, layout, batch and precision as composed; exit "
        "code 1 if it does not fit or the runtime would refuse it (lightning_5d/estimate/recipe_check.py)",
    )
    recipe.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides for --recipe")
    recipe.add_argument(
        "--gpu-mem",
        type=float,
        default=None,
        help="GiB per GPU: the recipe's is overridden; --plot marks layouts over it (default: the recipe's, else 80)",
    )
    sizes = est.add_argument_group("layout")
    sizes.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel size; goes to dp_shard when --zero >= 1, else dp_replicate",
    )
    sizes.add_argument("--dp-replicate", type=int, default=None)
    sizes.add_argument("--dp-shard", type=int, default=None)
    sizes.add_argument("--tp", type=int, default=1)
    sizes.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    sizes.add_argument("--cp", type=int, default=1)
    sizes.add_argument("--cp-mode", choices=_choices(ContextParallelMode), default=ContextParallelMode.RING.value,
                       help="how attention crosses the cp ranks")  # fmt: skip
    sizes.add_argument("--cp-ulysses", type=int, default=None, help="with --cp-mode hybrid: cp ranks per all-to-all")
    sizes.add_argument("--pp", type=int, default=1)
    sizes.add_argument("--ep", type=int, default=1)
    sizes.add_argument("--zero", type=int, choices=range(4), default=1)
    sizes.add_argument("--gpus", type=int, default=None, help="check that the sizes multiply to this")
    pipe = est.add_argument_group("pipeline and batch")
    pipe.add_argument("--schedule", choices=_choices(PipelineSchedule), default=PipelineSchedule.ONE_F_ONE_B.value)
    pipe.add_argument("--microbatches", type=int, default=None, help="m per pipeline run (default 2*pp)")
    pipe.add_argument("--virtual-stages", type=int, default=1, help="v for interleaved 1F1B")
    pipe.add_argument("--mbs", type=int, default=1, help="micro-batch size b (sequences)")
    pipe.add_argument("--grad-accum", type=int, default=1)
    pipe.add_argument("--recompute", choices=_choices(ActivationCheckpointing), default="none")
    est.set_defaults(func=run_estimate)

    pl = subparsers.add_parser(
        "plan",
        help="rank the layouts that fit a cluster by predicted step time",
        description="Enumerate valid layouts for a cluster, drop those that do not fit, "
        "rank the rest by predicted step time, and say why.",
    )
    _add_common(pl)
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    pl.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node")
    pl.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    pl.add_argument(
        "--peak-tflops", type=float, default=None, help="dense peak per GPU (default: H100 for --precision)"
    )
    pl.add_argument("--efficiency", type=float, default=0.5, help="assumed achieved/peak for compute")
    pl.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: the power of two nearest 4M tokens)",
    )
    pl.add_argument("--mbs", default="1,2,4", help="micro-batch sizes to try, comma separated")
    pl.add_argument(
        "--dims",
        default=",".join(sorted(ALL_DIMS)),
        help="dimensions the planner may use (dp = dp_replicate + dp_shard)",
    )
    pl.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to try, comma separated")
    pl.add_argument(
        "--recompute",
        default="none,selective,full",
        help="recompute modes to try, cheapest first; the first that fits is kept",
    )
    pl.add_argument("--allow-cross-node-tp", action="store_true")
    pl.add_argument("--top", type=int, default=10, help="how many layouts to show (0: all)")
    pl.set_defaults(func=run_plan)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _data_sizes(args: argparse.Namespace) -> dict[str, int]:
    if args.dp is not None and (args.dp_replicate is not None or args.dp_shard is not None):
        raise LayoutError("give either --dp or --dp-replicate/--dp-shard, not both.")
    if args.dp is not None:
        return {"dp_shard": args.dp} if args.zero >= 1 else {"dp_replicate": args.dp}
    return {"dp_replicate": args.dp_replicate or 1, "dp_shard": args.dp_shard or 1}


def default_global_batch(seq_len: int, tokens: float = DEFAULT_BATCH_TOKENS) -> int:
    """Sequences per step: the power of two nearest ``tokens / seq_len`` (so dp sizes divide it)."""
    return 2 ** max(0, round(math.log2(tokens / seq_len)))


def _seq_len(args: argparse.Namespace, spec) -> int:
    return args.seq or min(DEFAULT_SEQ_LEN, spec.max_seq_len)


def _fail(command: str, err: Exception) -> int:
    print(f"l5d {command}: error: {err}", file=sys.stderr)
    return 2


def run_recipe(args: argparse.Namespace) -> int:
    """`l5d estimate --recipe NAME [overrides]`: the planner's verdict on a recipe's exact layout."""
    import json

    from hydra.errors import HydraException

    cluster = {} if args.gpu_mem is None else {"gpu_memory_gib": args.gpu_mem}
    try:
        check = check_recipe_name(args.recipe, args.overrides, **cluster)
    except (LayoutError, ModelSpecError, OSError, ValueError, HydraException) as err:
        return _fail("estimate", err)
    print(json.dumps(check.to_dict(), indent=2) if args.json else check.format())
    if args.plot:
        from .plot import plot_memory

        try:
            c = check.cluster
            plot_memory(check.estimate, args.plot, gpu_memory_gib=c.gpu_memory_gib, memory_headroom=c.memory_headroom)
        except ImportError as err:
            return _fail("estimate", err)
    return 0 if check.fits and not check.problems else 1


def run_estimate(args: argparse.Namespace) -> int:
    if args.recipe:
        return run_recipe(args)
    if args.model is None or args.overrides:
        return _fail(
            "estimate", ValueError("give --model (with the layout flags) or --recipe NAME (with KEY=VALUE overrides)")
        )
    try:
        spec = load_spec(args.model)
        setup = TrainingSetup(
            **_data_sizes(args),
            tp=args.tp,
            cp=args.cp,
            cp_mode=args.cp_mode,
            cp_ulysses=args.cp_ulysses,
            pp=args.pp,
            ep=args.ep,
            zero=args.zero,
            sequence_parallel=not args.no_sp,
            schedule=args.schedule,
            microbatches=args.microbatches,
            virtual_stages=args.virtual_stages,
            recompute=args.recompute,
            precision=args.precision,
            fp32_grad_accumulation=args.fp32_grad_accum,
            state_accounting=args.state_accounting,
            micro_batch_size=args.mbs,
            seq_len=_seq_len(args, spec),
            grad_accum=args.grad_accum,
            attention=args.attention,
        )
        est = estimate(spec, setup, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    except (LayoutError, ModelSpecError, OSError) as err:
        return _fail("estimate", err)
    print(estimate_json(est) if args.json else format_estimate(est))
    if args.plot:
        from .plot import plot_memory

        try:
            # Judged against a GPU even without --gpu-mem, so an over-capacity layout is never drawn unmarked.
            gpu = Cluster(gpu_memory_gib=args.gpu_mem) if args.gpu_mem else Cluster()
            plot_memory(est, args.plot, gpu_memory_gib=gpu.gpu_memory_gib, memory_headroom=gpu.memory_headroom)
        except ImportError as err:
            return _fail("estimate", err)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    precision = Precision(args.precision)
    peak = (args.peak_tflops or DEFAULT_PEAK_TFLOPS[precision]) * 1e12
    cluster = Cluster(
        gpus=args.gpus,
        gpu_memory_gib=args.gpu_mem,
        gpus_per_node=args.gpus_per_node,
        intra_node_bandwidth=args.intra_bw * 1e9,
        inter_node_bandwidth=args.inter_bw * 1e9,
        peak_flops=peak,
        compute_efficiency=args.efficiency,
    )
    refused: Counter[Rule] = Counter()
    try:
        spec = load_spec(args.model)
        seq_len = _seq_len(args, spec)
        entries = plan(
            spec,
            cluster,
            seq_len=seq_len,
            global_batch=args.global_batch or default_global_batch(seq_len),
            micro_batch_sizes=_ints(args.mbs),
            available_dims=[d.strip() for d in args.dims.split(",") if d.strip()],
            zero_stages=_ints(args.zero),
            recompute_modes=[m.strip() for m in args.recompute.split(",")],
            precision=precision,
            fp32_grad_accumulation=args.fp32_grad_accum,
            allow_cross_node_tp=args.allow_cross_node_tp,
            top=args.top or None,
            refused=refused,
        )
    except (LayoutError, ModelSpecError, OSError, ValueError) as err:
        return _fail("plan", err)
    print(plan_json(entries) if args.json else format_plan(entries))
    # stderr under --json, so the output stays one JSON document
    print(refused_text(refused), file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        from .plot import plot_plan

        try:
            headroom = cluster.memory_headroom
            plot_plan(entries, args.plot, gpu_memory_gib=cluster.gpu_memory_gib, memory_headroom=headroom)
        except ImportError as err:
            return _fail("plan", err)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m lightning_5d.estimate.cli estimate ...`) until `l5d` wires it in."""
    parser = argparse.ArgumentParser(prog="l5d")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
