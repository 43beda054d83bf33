"""Render the layout matrix's recorded outcomes as docs/layout_matrix.md.

    python tests/distributed/scripts/layout_matrix_table.py RESULTS_DIR docs/layout_matrix.md [--minutes M]

RESULTS_DIR holds one JSON file per cell, written by tests/distributed/test_layout_matrix.py
when L5D_LAYOUT_MATRIX_OUT is set. Rows are the pairs (and the full combination), columns the
models; a refused or failed cell points to a note with the runtime's message.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

MODELS = ("llama", "qwen2", "gpt2", "mixtral")
TITLES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel",
          "mixtral": "MixtralForCausalLM"}  # fmt: skip
# Why each refusal is by design (keyed by a piece of the runtime's message).
WHY = {
    "ep > 1 with sequence_parallel": "Not supported yet (FiveDStrategy._parallelize): under sequence parallelism each "
    "tp rank holds a different sequence shard and would route different tokens; tp without sp passes with ep.",
    "tied embeddings": "GPT-2 ties its head to the token embedding (tie_word_embeddings=True, as published); the "
    "first and the last pipeline stage would both own that one parameter; the message asks for "
    "tie_word_embeddings=False, which this matrix does not try (it runs the published architecture).",
    "called with labels=": "The obvious GPT-2 module lets Hugging Face compute the loss (labels=input_ids); HF "
    "shifts the labels by one inside each rank's sequence shard, which under cp would drop every shard's boundary "
    "token, so the strategy refuses at the first forward instead of training on a wrong loss. The module that "
    "computes F.cross_entropy from the batch's aligned labels (as the Llama, Qwen2 and Mixtral modules do) runs "
    "under cp.",
}
# The zoo matrix's section of the same page (zoo_matrix_table.py writes it; kept here on rewrite).
ZOO_BEGIN = "<!-- zoo matrix: written by tests/distributed/scripts/zoo_matrix_table.py -->"
ZOO_END = "<!-- end of zoo matrix -->"
OPTIONS = ("dp", "zero1", "zero3", "tp", "tp+sp", "cp", "pp 1f1b", "pp interleaved", "ep")


def row_order(cell: dict) -> tuple:
    """Pairs in the order of the options (data, tensor, context, pipeline, experts), the full combination last."""
    names = cell["pair"].split(" x ")
    return tuple(OPTIONS.index(n) if n in OPTIONS else len(OPTIONS) for n in names)


def layout(cell: dict) -> str:
    dp = cell["nproc"] // (cell["tp"] * cell["cp"] * cell["pp"])
    parts = [f"dp{dp}" if dp > 1 else "", f"tp{cell['tp']}" + ("+sp" if cell["sp"] else "") if cell["tp"] > 1 else "",
             f"cp{cell['cp']}" if cell["cp"] > 1 else "", f"pp{cell['pp']}" if cell["pp"] > 1 else "",
             f"ep{cell['ep']}" if cell["ep"] > 1 else ""]  # fmt: skip
    return " ".join(p for p in parts if p) + f" ({cell['nproc']} processes)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--minutes", type=float, help="wall time of the whole matrix run")
    parser.add_argument("--note", default="", help="a sentence on how this run was made, for the page")
    args = parser.parse_args()
    cells = [json.loads(p.read_text()) for p in sorted(args.results.glob("*.json"))]
    by_pair: dict[str, dict[str, dict]] = {}
    for cell in sorted(cells, key=row_order):
        by_pair.setdefault(cell["pair"], {})[cell["model"]] = cell
    notes: dict[str, str] = {}  # explanation -> the first message that got it

    def note(cell: dict) -> int:
        message = cell["reason"].splitlines()[0][:400]
        why = next((text for key, text in WHY.items() if key in message), None)
        if cell["status"] == "fail" or why is None:
            why = f"**{cell['status'].capitalize()}, not explained** (to investigate)."
        notes.setdefault(why, message)
        return list(notes).index(why) + 1

    rows = []
    for pair, models in by_pair.items():
        any_cell = next(iter(models.values()))
        text = []
        for model in MODELS:
            cell = models.get(model)
            if cell is None:
                text.append("n/a (no experts)" if "ep" in pair.split(" x ") else "not run")
            elif cell["status"] == "pass":
                text.append(f"pass {cell['loss_error']:.0e} / {cell['param_error']:.0e} ({cell['seconds']:.0f} s)")
            else:
                text.append(f"{cell['status']} [{note(cell)}]")
        rows.append(f"| {pair} | {layout(any_cell)} | " + " | ".join(text) + " |")
    counts = {s: sum(c["status"] == s for c in cells) for s in ("pass", "refused", "fail")}

    lines = [
        "# Layout matrix: Hugging Face models under FiveDStrategy",
        "",
        "Hugging Face `LlamaForCausalLM`, `Qwen2ForCausalLM`, `GPT2LMHeadModel` and `MixtralForCausalLM`, built "
        "from small configs (4 layers, hidden 64, vocabulary 256; Mixtral with 4 experts, top-2) and wrapped "
        "unchanged in the obvious LightningModule (`tests/distributed/scripts/hf_support.py`), under every pair "
        "of layout options, each at size 2 on 4 processes, plus one full combination per model on 16 processes.",
        "Options: dp (ZeRO-0), zero1, zero3 | tp, tp+sp | cp (ring) | pp 1F1B, pp interleaved 1F1B "
        "(2 virtual stages) | ep (MoE only). A row without a data option runs zero=1; the processes left "
        "after tp x cp x pp are data ranks, and ep divides dp x cp.",
        "",
        "Each cell trains 5 steps in fp32 (4 sequences of 32 tokens per data rank; 4 microbatches under pp) and is "
        "compared with one process training the same module on the same global batches. **pass** means every "
        "step's loss and the final parameter vector agree within 1e-5 relative; the cell shows the largest "
        "per-step loss error / the parameter-vector error (relative) and the seconds `Trainer.fit` took (process "
        "start-up excluded). **refused** means the strategy raised its documented error before the first "
        "optimizer step, which the test asserts (message below).",
        "",
        f"Result: {counts['pass']} pass, {counts['refused']} refused, {counts['fail']} fail ({len(cells)} cells).",
        "",
        "Produced by (on demand; not part of `pytest` or `pytest -m slow`):",
        "",
        "```",
        "L5D_LAYOUT_MATRIX_OUT=outputs/layout_matrix \\",
        "  python -m pytest -m matrix tests/distributed/test_layout_matrix.py",
        "python tests/distributed/scripts/layout_matrix_table.py outputs/layout_matrix docs/layout_matrix.md",
        "```",
        "",
        f"Run on {datetime.date.today().isoformat()}, 2 CPU cores, gloo, torch {torch_version()}, "
        f"transformers {transformers_version()}"
        + (f"; the whole matrix took {args.minutes:.0f} minutes." if args.minutes else ".")
        + (f" {args.note}" if args.note else ""),
        "The fast tier (`pytest`) runs four of these cells: `test_layout_cell` in "
        "`tests/distributed/test_layout_matrix.py`.",
        "",
        "| pair | layout | " + " | ".join(TITLES[m] for m in MODELS) + " |",
        "|---|---|" + "---|" * len(MODELS),
        *rows,
        "",
        "## Cells that do not pass",
        "",
    ]
    for i, (why, message) in enumerate(notes.items(), 1):
        lines += [f"{i}. {why}", f"   Message: `{message}`", ""]
    page = args.output.read_text() if args.output.exists() else ""
    zoo_section = "\n" + page[page.index(ZOO_BEGIN) :] if ZOO_BEGIN in page else ""
    args.output.write_text("\n".join(lines).rstrip() + "\n" + zoo_section)
    print(f"{args.output}: {counts}", file=sys.stderr)


def torch_version() -> str:
    import torch

    return torch.__version__


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
