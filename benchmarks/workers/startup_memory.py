"""One start-up of a ~0.5 B model on every rank; rank 0 writes each rank's RSS figures.

Run by benchmarks/startup_memory.py under torch.distributed.run. The fit stops at
``on_train_start`` (after setup: the model is parallelized, materialized, the optimizer
built), before step 0. Measured per rank: the RSS before the model exists (baseline) and
the peak RSS up to that point (``ru_maxrss``). The ``_step`` variants go on through the first
training step and also record its peaks (VmHWM reset at ``on_train_start``): up to the
optimizer step (forward + backward) and through it; ``_fsdp_gather``: with FSDP2's own gather
of the one-parameter units instead of ours in place (parallel/data/gather_in_place.py).
With ``--phases`` also each phase's peak and, at
each phase boundary, RSS, its file pages and glibc's heap; with ``STARTUP_SMAPS=1`` as well, each
rank's /proc/self/smaps and threads at ``on_train_start`` (which mappings hold the pages), and at
each phase boundary the interpreter's small-object pools (``sys._debugmallocstats``: in use, free); with
``STARTUP_TRACE_COMPARE=1`` each step of the verifier's piece comparisons as a phase. With
``STARTUP_OBJECTS=DIR`` (a diagnostic: it traces every Python allocation, so its RSS figures are not
the benchmark's), rank 0 writes into DIR what Python allocated between the baseline and
``on_train_start`` and still holds there (tracemalloc, by file and by traceback), the change in
live objects by type, and glibc's ``malloc_info`` (its free chunks by size) at ``on_train_start``.
"""

import argparse
import ctypes
import json
import os
import resource
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import lightning_5d  # noqa: E402
from lightning_5d.models import LlamaConfig, LlamaLM  # noqa: E402
from lightning_5d.parallel.tensor import TensorParallel  # noqa: E402
from train import HandShardedLM  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--variant", required=True)
parser.add_argument("--model", required=True, help="LlamaConfig fields as JSON")
parser.add_argument("--out", required=True)
parser.add_argument("--phases", action="store_true", help="also the peak RSS inside each start-up phase")


def rss_bytes(field: str = "VmRSS") -> int:
    """``field`` of /proc/self/status in bytes: VmRSS (all resident pages), RssFile (of them, mapped
    files: the libraries' code and data)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class StopBeforeStep(L.Callback):
    def __init__(self, first_step: bool = False):
        self.peak = None
        self.first_step = first_step  # go on through step 0 and record its peaks
        self.step_peaks: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.rss_at_start = rss_bytes()
        if OBJECTS is not None:
            OBJECTS.at_train_start()
        if not self.first_step:
            trainer.should_stop = True
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the step's own peak from here

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first_step and "forward_backward" not in self.step_peaks:
            self.step_peaks["forward_backward"] = rss_bytes("VmHWM")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_step and "step" not in self.step_peaks:
            self.step_peaks["step"] = rss_bytes("VmHWM")
            trainer.should_stop = True


def pymalloc_stats() -> dict[str, int]:
    """The interpreter's small-object allocator (``sys._debugmallocstats``): arenas, bytes in live
    blocks, free blocks in used pools, whole free pools (resident once touched)."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    wanted = {"# arenas allocated current": "arenas", "bytes in allocated blocks": "allocated",
              "bytes in available blocks": "available", "unused pools * 16384 bytes": "unused_pools",
              "bytes lost to pool headers": "pool_headers", "bytes lost to quantization": "quantization"}  # fmt: skip
    out = {}
    for line in text.splitlines():
        for prefix, key in wanted.items():
            if prefix in line:
                out[key] = int(line.split("=")[-1].replace(",", "").strip())
    return out


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (the fields read here: heap size, in use, free, mmapped)."""

    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def heap_info() -> dict[str, int]:
    """The main thread's view of glibc's heap: bytes in use, free but kept, and in mmapped chunks
    (empty where the C library is not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd}


class PhaseRSS:
    """Peak RSS per start-up phase: a thread samples /proc/self/status every 5 ms and charges the
    sample to the phase running then (phases are the strategy's steps, wrapped here). ``marks``:
    RSS and the glibc heap at each phase's start and end, in order (where each MiB goes)."""

    def __init__(self):
        import threading

        self.phase = "before setup"
        self.peaks: dict[str, int] = {}
        self.marks: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.005):
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            outer, self.phase = self.phase, label
            self.mark(f"{label}: start")
            try:
                return original(*args, **kwargs)
            finally:
                self.peaks[label] = max(self.peaks.get(label, 0), rss_bytes())
                self.mark(f"{label}: end")
                self.phase = f"after {label}"

        setattr(owner, name, wrapped)

    def mark(self, label: str) -> None:
        mark = {"label": label, "rss": rss_bytes(), "file": rss_bytes("RssFile"), **heap_info()}
        if os.environ.get("STARTUP_SMAPS"):  # and the interpreter's small-object pools
            py = pymalloc_stats()
            mark.update(py_used=py["allocated"], py_free=py["available"] + py["unused_pools"])
        self.marks.append(mark)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def watch_phases() -> PhaseRSS:
    """Wrap the start-up's steps (ours and Lightning's) as phases."""
    from lightning_5d import dimensions, strategy
    from lightning_5d.materialize.build import MetaBuild

    phases = PhaseRSS()
    phases.wrap(dimensions.Discover, "apply", "discover (probe)")
    phases.wrap(dimensions.SnapshotPieces, "apply", "snapshot")
    phases.wrap(dimensions.Data, "_fsdp", "fully_shard + materialize")
    phases.wrap(MetaBuild, "materialize", "materialize (replay)")
    from lightning_5d.verify import check

    phases.wrap(dimensions.Verify, "apply", "verify")
    phases.wrap(check, "run_probe", "verify: probe forward")
    if os.environ.get("STARTUP_TRACE_PROBE"):
        trace_probe_modules(phases, check)
    phases.wrap(check.PlanCheck, "_compare", "verify: compare pieces")
    if os.environ.get("STARTUP_TRACE_COMPARE"):  # the steps of each piece's comparison
        phases.wrap(check, "full_weights", "compare: gather full weights")
        phases.wrap(check, "materialize", "compare: reference piece")
        phases.wrap(check, "difference", "compare: output difference")
        phases.wrap(check, "reference_grads", "compare: reference backward")
        phases.wrap(check, "keep_rank_parts", "compare: keep the rank's parts")
        phases.wrap(check, "release_freed_memory", "compare: release freed memory")
        phases.wrap(check.ParallelGrads, "of", "compare: parallel backward")
        phases.wrap(check, "shard_differences", "compare: gradient difference")
    phases.wrap(strategy.FiveDStrategy, "setup_optimizers", "optimizer")
    phases.wrap(strategy.FiveDStrategy, "setup", "setup (all)")
    phases.wrap(strategy.FiveDStrategy, "setup_environment", "process group + mesh")
    for step in dimensions.STEPS:  # the other steps (wrapped above under their own labels)
        if type(step) not in (dimensions.Discover, dimensions.SnapshotPieces, dimensions.Verify):
            phases.wrap(type(step), "apply", f"step {step.name}")
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.strategies import model_parallel

    phases.wrap(ModelParallelStrategy, "setup_environment", "process group + mesh")
    phases.wrap(ModelParallelStrategy, "setup", "setup (all)")
    phases.wrap(model_parallel, "_materialize_distributed_module", "materialize (reset_parameters)")
    phases.wrap(HandShardedLM, "configure_model", "fully_shard")
    return phases


def trace_probe_modules(phases: PhaseRSS, check) -> None:
    """Finer phases inside the probe forward: one per FSDP2 unit's forward, and the glibc heap's
    free bytes after each (mallinfo2: memory the allocator holds but no tensor uses)."""
    from torch.distributed.fsdp import FSDPModule

    inner = check.run_probe

    def traced(module, batch, forward):
        handles = []
        for name, m in module.named_modules():
            if not isinstance(m, FSDPModule):
                continue

            def pre(_m, _a, name=name):
                phases.phase = f"probe: {name or 'root'}"

            def post(_m, _a, _o, name=name):
                heap = {k: v >> 20 for k, v in heap_info().items()}
                phases.peaks[f"probe: {name or 'root'} done; heap (MiB) {heap}"] = rss_bytes()
                phases.phase = f"probe: after {name or 'root'}"

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        try:
            return inner(module, batch, forward)
        finally:
            for h in handles:
                h.remove()

    check.run_probe = traced
    compare = check.PlanCheck._compare

    def compare_traced(self, piece, *a, **k):
        outer, phases.phase = phases.phase, f"compare: {piece.path}"
        try:
            return compare(self, piece, *a, **k)
        finally:
            phases.phase = outer

    check.PlanCheck._compare = compare_traced
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    counter = [0]
    for method in ("unshard", "wait_for_unshard", "reshard", "post_forward"):
        original = getattr(pg.FSDPParamGroup, method)

        def wrapped(self, *a, _original=original, _method=method, **k):
            outer = phases.phase
            counter[0] += 1
            label = f"{counter[0]:04d} {outer} / {_method} {self._module_fqn}"
            start = rss_bytes()
            phases.phase = label
            try:
                return _original(self, *a, **k)
            finally:
                phases.peaks[label] = max(phases.peaks.get(label, 0), rss_bytes())
                phases.peaks[label + " (start)"] = start
                phases.phase = outer

        setattr(pg.FSDPParamGroup, method, wrapped)


class HeldObjects:
    """``STARTUP_OBJECTS=DIR``: what Python objects the start-up leaves alive (see the module docstring)."""

    def __init__(self, out: str, variant: str):
        import gc
        import tracemalloc

        self.out, self.variant = Path(out), variant
        tracemalloc.start(30)
        gc.collect()
        self.types = self._types()
        self.snapshot = tracemalloc.take_snapshot()

    def _by_caller(self, now, title: str) -> list[str]:
        """Bytes held now that were allocated after the baseline, by the innermost frame in this
        repository's code and the innermost frame (tracemalloc lists frames oldest first)."""
        import collections

        root = str(Path(lightning_5d.__file__).parent.parent)

        def where(trace) -> str:
            frames = trace.traceback
            ours = [f for f in frames if f.filename.startswith(root)]
            inner = str(frames[-1])
            return inner if not ours or ours[-1] is frames[-1] else f"{ours[-1]} -> {inner}"

        by, count = collections.Counter(), collections.Counter()
        for sign, snapshot in ((1, now), (-1, self.snapshot)):
            for trace in snapshot.traces:
                w = where(trace)
                by[w] += sign * trace.size
                count[w] += sign
        lines = [f"== {title}: total {sum(by.values()) / 2**20:+.3f} MiB"]
        lines += [f"{n / 1024:+10.1f} KiB {count[w]:+7d} blocks  {w}" for w, n in by.most_common(60) if n > 0]
        return lines

    @staticmethod
    def _types() -> dict[str, int]:
        import collections
        import gc

        return collections.Counter(type(o).__qualname__ for o in gc.get_objects())

    def at_train_start(self) -> None:
        import gc
        import tracemalloc

        now = tracemalloc.take_snapshot()
        types = self._types()
        if int(os.environ.get("RANK", "0")) != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        lines = []
        for key in ("filename", "traceback"):
            diff = now.compare_to(self.snapshot, key)
            total = sum(d.size_diff for d in diff)
            lines.append(f"== by {key}: total {total / 2**20:+.3f} MiB")
            for d in diff[:60 if key == "filename" else 40]:
                lines.append(f"{d.size_diff / 1024:+10.1f} KiB {d.count_diff:+7d} blocks")
                frames = d.traceback.format()[-16:] if key == "traceback" else [str(d.traceback[0])]
                lines += ["      " + f for f in frames]
        lines += self._by_caller(now, "allocated under (innermost frame of the project or the worker)")
        gc.collect()  # after the figures above: what of it was garbage in reference cycles
        lines += self._by_caller(tracemalloc.take_snapshot(), "the same after gc.collect() (live, not garbage)")
        changed = {t: types.get(t, 0) - self.types.get(t, 0) for t in set(types) | set(self.types)}
        lines.append("== live objects by type (gc-tracked), change")
        lines += [f"{n:+8d} {t}" for t, n in sorted(changed.items(), key=lambda kv: -abs(kv[1]))[:60] if n]
        (self.out / f"{self.variant}.objects.txt").write_text("\n".join(lines))
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        stream = libc.fopen(str(self.out / f"{self.variant}.malloc_info.xml").encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))


OBJECTS: HeldObjects | None = None


def keep_tp_references() -> None:
    """The behaviour before the fix: TensorParallel kept every tp-local tensor it made."""
    cut = TensorParallel._apply

    def apply_and_keep(self, root):
        cut(self, root)
        self.kept = [p for n, p in root.named_parameters() if n in self.shards]

    TensorParallel._apply = apply_and_keep


def old_probe() -> None:
    """Discovery's probes on a meta build as they were before the saved weights were packed: each
    recomputed parameter a leaf that wants a gradient (its graph node holds it), every value a
    backward needs kept by the graph, no trim between recomputations, and values kept up to the
    larger of the share and the largest tensor."""
    import math

    from lightning_5d.materialize import build, stand_in

    real = stand_in.RecordedValues._real

    def real_wanting_grad(self, x):
        value = real(self, x)
        if isinstance(x, torch.Tensor) and x.requires_grad and value is not x and torch.is_grad_enabled():
            value = value.detach().requires_grad_(True)
        return value

    stand_in.RecordedValues._real = real_wanting_grad
    stand_in.RecordedValues._pack = lambda self, t: t.detach()
    stand_in.release_freed_memory = lambda: None

    def old_budget(module, log, budget=None):
        sizes = [t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if t.is_meta]
        share = math.ceil(sum(sizes) / dist.get_world_size())
        return stand_in.RecordedValues(log, max(max(sizes), share) if budget is None else budget)

    build.recorded_values = old_budget


class NeoXLM(L.LightningModule):
    """Hugging Face GPT-NeoX (fused ``query_key_value``, interleaved per head): discovery observes
    its column order with a forward and backward on the model's initial values."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        import transformers as tf

        self.model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads, max_position_embeddings=64,
            attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=False))  # fmt: skip

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class HandShardedNeoXLM(NeoXLM):
    """What a user writes for ModelParallelStrategy: ``fully_shard`` per block, then the root."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.gpt_neox.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fsdp_gather() -> None:
    """FSDP2's own gather for every unit: nothing gathers in place."""
    from lightning_5d.parallel.data import fsdp

    fsdp.gather_in_place = lambda units: 0


def main() -> None:
    args = parser.parse_args()
    config = LlamaConfig(**json.loads(args.model))
    phases = watch_phases() if args.phases else None
    if os.environ.get("STARTUP_OBJECTS"):
        global OBJECTS
        OBJECTS = HeldObjects(os.environ["STARTUP_OBJECTS"], args.variant)
    baseline = rss_bytes()
    if phases is not None:
        phases.mark("baseline")
    v = args.variant
    build = "meta" if "meta" in v else "eager"
    if v.startswith("lightning"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
        cls = HandShardedNeoXLM if "neox" in v else HandShardedLM
    else:
        tp = 2 if "tp2" in v else 1
        pp = 2 if "pp2" in v else 1
        if "old" in v:
            keep_tp_references()
        if "fsdp_gather" in v:
            fsdp_gather()
        if "old_probe" in v:
            old_probe()
        # The default (auto) checks nothing under ZeRO-3 alone; verify_blocks forces the check there.
        verify = "off" if "verify_off" in v else "blocks" if "verify_blocks" in v else "auto"
        strategy = lightning_5d.FiveDStrategy(zero=3, tp=tp, pp=pp, pipeline={"microbatches": 2}, verify=verify)
        cls = NeoXLM if "neox" in v else LlamaLM
    L.seed_everything(0, verbose=False)
    model = cls(config) if build == "eager" else None
    stop = StopBeforeStep(first_step="_step" in v)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[stop])  # fmt: skip
    if build == "meta":
        if phases is not None:
            phases.phase = "build on meta (record)"
            phases.mark("build on meta: start")
        with trainer.init_module(empty_init=True):
            model = cls(config)
        if phases is not None:
            phases.mark("build on meta: end")
            phases.phase = "after build"
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the whole model, before any cut
    ids = torch.randint(0, config.vocab_size, (64, 17))
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2, drop_last=True))
    # After setup: at on_train_start (the _step variants' fit has gone on through a step since).
    record = {"baseline": baseline, "peak": stop.peak, "rss_after_setup": stop.rss_at_start,
              "model_bytes": model_bytes}
    if stop.first_step:
        record["step_peaks"] = stop.step_peaks
    if phases is not None and os.environ.get("STARTUP_SMAPS"):
        record["smaps"] = Path("/proc/self/smaps").read_text()
        record["pymalloc"] = pymalloc_stats()
        record["threads"] = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip()
                                   for t in os.listdir("/proc/self/task"))  # fmt: skip
    if phases is not None:
        phases.mark("on_train_start (end of setup)")
        record["phases"], record["marks"] = phases.stop(), phases.marks
    write_ranks_and_leave(record, args.out)


def write_ranks_and_leave(record: dict, out: str) -> None:
    """Every rank's ``record`` into ``out`` (written by rank 0), then leave the process group."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, record)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"ranks": per_rank}))
    from lightning_5d.testing import leave_process_group

    leave_process_group()


if __name__ == "__main__":
    main()
