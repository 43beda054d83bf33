"""Shared by the multi-process scripts and the single-process references of the tests."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import lightning as L
import torch

from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
from lightning_5d.models.llama import LlamaModel

# Small enough for 4 processes on 2 cores, big enough to have several blocks and buckets.
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
MODELS = {
    "tiny": TINY,
    "tiny_kv4": replace(TINY, num_kv_heads=4),  # tp=4 needs 4 kv heads
    "tiny_tied": replace(TINY, tie_embeddings=True),
    "tiny_deep": replace(TINY, num_layers=8),  # pp=4 x virtual_stages=2 needs 8 blocks
    "tiny_moe": replace(TINY, num_experts=4, experts_top_k=2, num_shared_experts=1, moe_intermediate_size=64),
}
MODELS["tiny_tied_deep"] = replace(MODELS["tiny_deep"], tie_embeddings=True)  # pp: the head's weight is the embedding's
MODELS["tiny_moe_deep"] = replace(MODELS["tiny_moe"], num_layers=4)  # pp=2 x virtual_stages=2 needs 4 blocks
# tp=2 x all-to-all/hybrid cp=2: each tp rank's 2 query and 2 kv heads are sharded again over the Ulysses group
MODELS["tiny_deep_kv4"] = replace(MODELS["tiny_deep"], num_kv_heads=4)
MODELS["tiny_moe_deep_kv4"] = replace(MODELS["tiny_moe_deep"], num_kv_heads=4)
SEQ_LEN = 32
BATCH_SIZE = 2  # per data rank
NUM_SAMPLES = 256


def set_trainable_matching(module: torch.nn.Module, pattern: str, trainable: bool) -> None:
    """``requires_grad_(trainable)`` on the parameters whose names match ``pattern``, as a user
    fine-tuning part of a model does where it builds the model (or a schedule that unfreezes)."""
    for name, param in module.named_parameters():
        if re.search(pattern, name):
            param.requires_grad_(trainable)


def unfreeze_matching(module: torch.nn.Module, pattern: str) -> None:
    if pattern is None or pattern == "lora":
        raise ValueError("--unfreeze-at takes the regex of --freeze")
    set_trainable_matching(module, pattern, True)


class LoraLinear(torch.nn.Module):
    """A low-rank adapter around a frozen linear, laid out as peft's LoRA layer is: ``base_layer``,
    ``lora_A.default`` and ``lora_B.default`` (B starts at zero, so the model starts unchanged),
    ``in_features`` / ``out_features`` and a ``weight`` property that returns the base's."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, base.out_features, bias=False)})
        torch.nn.init.zeros_(self.lora_B["default"].weight)
        self.scaling = alpha / rank

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


def add_lora(module: torch.nn.Module, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> None:
    """Freeze every parameter and wrap the ``targets`` linears in :class:`LoraLinear` (peft's default
    for Llama: the query and value projections)."""
    module.requires_grad_(False)
    for name, child in list(module.named_modules()):
        for target in targets:
            inner = getattr(child, target, None)
            if isinstance(inner, torch.nn.Linear):
                setattr(child, target, LoraLinear(inner))


def apply_freeze(module: torch.nn.Module, freeze: str | None) -> None:
    """``freeze``: "lora" (:func:`add_lora`), or a regex of the parameter names to freeze."""
    if freeze == "lora":
        add_lora(module)
    elif freeze is not None:
        set_trainable_matching(module, freeze, False)


def decay_groups(module: torch.nn.Module, lr: float) -> list[dict]:
    """Parameter groups as nanoGPT and Hugging Face's Trainer build them: weight decay on the
    matrices only, none on norms; the embedding and the head (found by name) with learning rates
    of their own. Under pp2 the first stage builds [embedding, decay, no_decay] and the last
    [head, decay, no_decay]: as many groups, other options at the same positions."""
    groups = {"embedding": [], "head": [], "decay": [], "no_decay": []}
    for name, p in module.named_parameters():
        if p.requires_grad:
            key = "embedding" if "embed" in name else "head" if "lm_head" in name else None
            groups[key or ("decay" if p.dim() >= 2 else "no_decay")].append(p)
    options = {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0},
               "embedding": {"weight_decay": 0.0, "lr": 0.3 * lr}, "head": {"weight_decay": 0.05, "lr": 0.5 * lr}}
    return [{"params": params, **options[key]} for key, params in groups.items() if params]


class RecordingLM(LlamaLM):
    """The reference model, unchanged, plus a record of each micro-batch's loss.

    ``optimizer_groups="decay"``: :func:`decay_groups` instead of one group of every parameter."""

    def __init__(self, config: LlamaConfig = TINY, freeze: str | None = None, optimizer_groups: str | None = None,
                 **kwargs):  # fmt: skip
        # Lightning records this frame's arguments as hyperparameters: keep them plain
        # data so checkpoints load with torch.load(weights_only=True).
        config = asdict(config) if isinstance(config, LlamaConfig) else config
        super().__init__(config=config, **kwargs)
        self.losses = []
        self.freeze = freeze
        self.optimizer_groups = optimizer_groups
        apply_freeze(self, freeze)

    def configure_optimizers(self):
        if self.optimizer_groups is None:
            return super().configure_optimizers()
        hp = self.hparams
        optimizer = torch.optim.AdamW(decay_groups(self, hp.lr), lr=hp.lr, betas=tuple(hp.betas))
        if hp.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


class ConfiguredLM(RecordingLM):
    """The reference model, built in ``configure_model`` (where Lightning builds large models)."""

    def __init__(self, config: LlamaConfig = TINY, **kwargs):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # only for LlamaLM's hparams
            super().__init__(config, **kwargs)
        del self.model

    def configure_model(self):
        if getattr(self, "model", None) is None:
            config = self.hparams.config
            self.model = LlamaModel(config if isinstance(config, LlamaConfig) else LlamaConfig(**config))
            apply_freeze(self, self.freeze)


def make_datamodule(num_samples: int | None = None, batch_size: int = BATCH_SIZE) -> TextDataModule:
    return TextDataModule(
        seq_len=SEQ_LEN, batch_size=batch_size, num_samples=num_samples or NUM_SAMPLES, val_samples=16
    )


SCRIPTS = Path(__file__).parent


def run_distributed(script, nproc: int, args=(), timeout: float = 240.0, env=None):
    """The tests' launcher: ranks forked from a preloaded interpreter (lightning_5d.fork_launch).

    It saves each rank's torch/Lightning import, most of a short run's cost. The requeue
    tests, which send signals through torchrun, and the harness test use
    lightning_5d.testing.run_distributed's torchrun launcher instead.
    """
    from lightning_5d.testing import Launcher
    from lightning_5d.testing import run_distributed as launch

    return launch(script, nproc, args, timeout=timeout, env=env, launcher=Launcher.FORK)


def layout_args(zero, dp_replicate: int = 1, accumulate: int = 1, clip=None, steps: int = 5,
                precision: str = "32-true", extra=(), tp: int = 1, sp: bool = False, model: str = "tiny",
                cp: int = 1) -> list[str]:  # fmt: skip
    """train_llama.py's arguments for one run of TINY (or ``model``) under FiveDStrategy."""
    args = ["--zero", str(zero), "--dp-replicate", str(dp_replicate), "--accumulate", str(accumulate),
            "--steps", str(steps), "--precision", precision, "--tp", str(tp),
            "--model", model, "--cp", str(cp), *(["--sp"] if sp else []), *extra]  # fmt: skip
    return args if clip is None else [*args, "--clip", str(clip)]


def read_run(out: Path):
    """(result.json, final full params) of one train_llama.py run."""
    return json.loads((out / "result.json").read_text()), torch.load(out / "params.pt")


def run_layout(out: Path, nproc: int, zero, dp_replicate: int = 1, accumulate: int = 1, clip=None, *,
               timeout: float = 240, **options):  # fmt: skip
    """Train TINY under FiveDStrategy on ``nproc`` processes; returns (result.json, final params)."""
    args = [*layout_args(zero, dp_replicate, accumulate, clip, **options), "--out", str(out)]
    run_distributed(SCRIPTS / "train_llama.py", nproc, args, timeout=timeout).check()
    return read_run(out)


class LayoutRuns:
    """A test module's cases of train_llama.py, run in one launch per process count on first use.

    Starting the ranks (torch and Lightning imported on every process) costs more than a tiny
    case; one launch trains every case of the same process count one after another.
    ``cases`` maps a key (a test's parameters) to ``(nproc, run_layout options)``; build it with
    :func:`selected_cases` so that only the tests pytest selected (-m, -k) are run.
    """

    def __init__(self, out: Path, cases: dict, timeout_per_case: float = 60):
        self.out, self.cases, self.timeout_per_case = out, cases, timeout_per_case
        self.ids = {key: f"case{i}" for i, key in enumerate(cases)}
        self.done: set[int] = set()

    def __getitem__(self, key):
        nproc = self.cases[key][0]
        if nproc not in self.done:
            self._launch(nproc)
        return read_run(self.out / self.ids[key])

    def _launch(self, nproc: int) -> None:
        batch = [{"argv": layout_args(**options), "out": str(self.out / self.ids[key])}
                 for key, (n, options) in self.cases.items() if n == nproc]  # fmt: skip
        listing = self.out / f"cases_{nproc}.json"
        listing.write_text(json.dumps(batch))
        self.done.add(nproc)  # a failed launch fails every case of it, once
        timeout = 60 + self.timeout_per_case * len(batch)
        run_distributed(SCRIPTS / "train_llama.py", nproc, ["--cases", str(listing)], timeout=timeout).check()


def selected_cases(request, case_of) -> dict:
    """``{key: (nproc, options)}`` for the selected tests of the requesting module.

    ``case_of(test_name, params)`` returns ``(key, (nproc, options))`` for a test that trains
    through :class:`LayoutRuns` (a dict of them for a test that reads several runs), or None. Reading the session's selected items keeps a batch to
    what this pytest run asked for: a fast-tier run does not train the slow cases.
    """
    cases = {}
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            callspec = getattr(item, "callspec", None)
            found = case_of(item.originalname, callspec.params if callspec else {})
            if isinstance(found, tuple):
                found = dict([found])
            cases.update(found or {})
    return cases


def parameter_vector_error(params: dict, ref_params: dict) -> float:
    """|p - p_ref| / |p_ref| over all parameters as one vector (keys must match)."""
    assert params.keys() == ref_params.keys()
    diff = sum((params[k].double() - v.double()).norm() ** 2 for k, v in ref_params.items()) ** 0.5
    total = sum(v.double().norm() ** 2 for v in ref_params.values()) ** 0.5
    return float(diff / total)


def relative(a, b) -> float:
    """The largest per-step difference of two loss curves, relative to the smaller ``b``."""
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item() / torch.tensor(b).abs().min().item()


LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5


def assert_equivalent(losses, params, ref_losses, ref_params):
    """Every step's loss within 1e-5 relative; the parameter vector within 1e-5 relative."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    error = parameter_vector_error(params, ref_params)
    assert error <= PARAM_RTOL, f"parameters differ by {error:.2e} relative"


class RecordReturned(L.Callback):
    """The loss every rank got back from training_step (under pp the step runs per microbatch
    on the last stage only, and the strategy hands the loss to every rank)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone().float())


def cases_through(script: str, tmp_path, cases: dict, nproc: int, timeout: float = 300.0) -> dict:
    """Each case of ``cases`` (name -> case) through ``script``'s :func:`run_cases_and_leave` in
    ``nproc`` processes: name -> what rank 0 saved for it."""
    out = tmp_path / f"results-{Path(script).stem}-{nproc}.pt"
    args = ["--cases", json.dumps(list(cases.values())), "--out", str(out)]
    run_distributed(SCRIPTS / script, nproc, args, timeout=timeout).check()
    return dict(zip(cases, torch.load(out, weights_only=False)))


def run_cases_and_leave(run) -> None:
    """A case script's main (``--cases JSON --out FILE``): each case through ``run`` in these
    processes, rank 0 saves the list of results to FILE, then every rank leaves the group."""
    import argparse

    import torch.distributed as dist

    from lightning_5d.testing import leave_process_group

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = [run(case) for case in json.loads(args.cases)]
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    leave_process_group()
