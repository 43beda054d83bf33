"""Render the zoo matrix's outcomes (scripts/zoo_matrix.py) as a section of docs/layout_matrix.md.

    python tests/distributed/scripts/zoo_matrix_table.py RESULTS_DIR docs/layout_matrix.md [--note TEXT]

Replaces the part of the page from ZOO_BEGIN to ZOO_END (appends it when missing); the rest of
the page is layout_matrix_table.py's, which keeps this part when it rewrites the page.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package
import zoo  # noqa: E402
from layout_matrix_table import ZOO_BEGIN, ZOO_END  # noqa: E402
from zoo_matrix import FP8_LOSS_RTOL, LAYOUTS, LOSS_RTOL, STATUSES, STEPS  # noqa: E402


def cell_text(outcome: dict, note) -> str:
    status = outcome["status"]
    if status == "pass":
        return f"pass {outcome['loss_error']:.0e}"
    if status == "refused":
        text = f"refused [{note(outcome)}]"
        advice = outcome.get("advice")
        if advice:
            text += f"; advice: {advice['status']}" + (f" [{note(advice)}]" if advice["status"] in ("refused", "crash", "wrong loss") else "")  # noqa: E501
        return text
    if status == "wrong loss":
        params = "names differ" if outcome.get("param_error") is None else f"{outcome['param_error']:.0e}"
        return f"**WRONG LOSS** {outcome['loss_error']:.0e} / params {params}"  # the numbers: the section below
    return f"**crash** [{note(outcome)}]"


def render(outcomes: list[dict], run: dict, note_text: str) -> str:
    layouts = [lay for lay in LAYOUTS if any(o["layout"] == lay for o in outcomes)]
    by = {(o["model"], o["layout"]): o for o in outcomes}
    notes: dict[str, int] = {}

    def note(outcome: dict) -> int:
        return notes.setdefault(outcome["reason"], len(notes) + 1)

    rows = []
    for model in zoo.MODELS:
        cells = [by.get((model, lay)) for lay in layouts]
        rows.append(f"| `{model}` | " + " | ".join(cell_text(c, note) if c else "not run" for c in cells) + " |")
    for model in zoo.VARIANTS:  # a refusal's advice followed (zoo/variants.py): the cp layouts only
        cells = [by.get((model, lay)) for lay in layouts]
        if any(cells):
            text = " | ".join(cell_text(c, note) if c else "-" for c in cells)
            rows.append(f"| `{model}` (variant) | {text} |")
    counts = [f"| {lay} | {LAYOUTS[lay][0]} | "
              + " | ".join(str(sum(o["status"] == s for o in outcomes if o["layout"] == lay)) for s in STATUSES)
              + " |" for lay in layouts]  # fmt: skip
    totals = {s: sum(o["status"] == s for o in outcomes) for s in STATUSES}
    advised = [o["advice"] for o in outcomes if o.get("advice")]
    advice_counts = {s: sum(a["status"] == s for a in advised) for s in (*STATUSES, "not tried")}
    import torch
    import transformers

    lines = [
        ZOO_BEGIN,
        "## The zoo: models written differently (issue 22)",
        "",
        f"{len(zoo.MODELS)} small causal LMs (hidden 64, 2 blocks, 4 query heads, vocabulary 256; `tests/zoo/`), "
        "each in the obvious LightningModule (`zoo.adapter.ZooLM`: cross entropy from the batch's aligned labels, "
        f"AdamW) or, for `direct_lm`, holding its parameters on the LightningModule itself. "
        f"{len(zoo.MODELS) - len(zoo.HUGGING_FACE)} are hand-written in the styles people use; "
        f"{len(zoo.HUGGING_FACE)} are Hugging Face families beyond the four above. `einops_style` needs `einops` "
        "(in the `dev` extra).",
        "",
        "| model | what makes it different |",
        "|---|---|",
        *[f"| `{name}` | {what} |" for name, (_, what) in zoo.MODELS.items()],
        "",
        f"Each cell trains {STEPS} steps (2 sequences of 32 tokens per data rank; 2 microbatches under pp) and is "
        f"compared with one process training the same module from the same seed on the same global batches. "
        f"**pass**: every step's loss within {LOSS_RTOL:.0e} relative and the final parameter vector within 1e-5 "
        f"(the cell shows the largest loss error); under `fp8` (FiveDPrecision tensorwise, 2 data ranks) every "
        f"step's loss within {FP8_LOSS_RTOL:.0e} of the fp32 process, as tests/distributed/test_precision.py "
        "allows per step. **refused**: lightning_5d raised one of its own errors (note below). Where the "
        "refusal prints a `model_plan` snippet, the runner fills in the head counts (the one thing the snippet "
        "leaves to the user when it found the modules) and runs the cell again with that plan: *advice: pass* "
        "means the advice works; *not tried* means the snippet still had `<placeholders>` for modules. "
        "**WRONG LOSS**: it trained without an error but the losses or parameters differ from one process "
        "(loss error / parameter error shown; each was run again alone in fresh processes). **crash**: "
        "any other exception, or a hang.",
        "",
        "Produced by (on demand; `pytest -m extended tests/distributed/test_zoo_matrix.py` runs the same cells "
        "as tests):",
        "",
        "```",
        "python tests/distributed/scripts/zoo_matrix.py --out outputs/zoo_matrix",
        "python tests/distributed/scripts/zoo_matrix_table.py outputs/zoo_matrix docs/layout_matrix.md",
        "```",
        "",
        f"Run on {datetime.date.today().isoformat()}, 2 shared CPU cores, gloo, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; the whole zoo matrix took {run.get('minutes', 0):.0f} minutes."
        + (f" {note_text}" if note_text else ""),
        "",
        f"Result: {totals['pass']} pass, {totals['refused']} refused, {totals['wrong loss']} wrong loss, "
        f"{totals['crash']} crash ({len(outcomes)} cells). Refusals whose advice was tried: "
        + ", ".join(f"{n} {s}" for s, n in advice_counts.items() if n) + ".",
        "",
        "| layout | processes | " + " | ".join(STATUSES) + " |",
        "|---|---|" + "---|" * len(STATUSES),
        *counts,
        "",
        "| model | " + " | ".join(layouts) + " |",
        "|---|" + "---|" * len(layouts),
        *rows,
        "",
    ]
    wrong = [o for o in outcomes if o["status"] == "wrong loss"]
    advice_wrong = [o for o in outcomes if o.get("advice", {}).get("status") == "wrong loss"]
    if wrong or advice_wrong:
        lines += ["### Cells that train with a wrong loss", ""]
        for o in wrong + advice_wrong:
            run_of = o if o["status"] == "wrong loss" else o["advice"]
            label = "" if o["status"] == "wrong loss" else " (following the refusal's model_plan)"
            confirmed = {True: "; the same losses again alone in fresh processes",
                         False: "; **not** reproduced alone in fresh processes"}.get(o.get("confirmed"), "")  # fmt: skip
            losses = ", ".join(f"{x:.6f}" for x in run_of.get("losses") or [])
            ref = ", ".join(f"{x:.6f}" for x in run_of.get("ref_losses") or [])
            lines.append(f"- `{o['model']}` under {o['layout']}{label}: {run_of['reason']}; losses [{losses}] vs "
                         f"one process [{ref}]{confirmed}.")  # fmt: skip
        lines.append("")
    lines += ["### Notes (the first line of each message)", ""]
    lines += [f"{i}. `{reason}`" for reason, i in notes.items()]
    lines += ["", ZOO_END]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--note", default="", help="a sentence on how this run was made, for the page")
    args = parser.parse_args()
    outcomes = [json.loads(p.read_text()) for p in sorted((args.results / "outcomes").glob("*.json"))]
    run = json.loads((args.results / "run.json").read_text())
    section = render(outcomes, run, args.note)
    page = args.output.read_text() if args.output.exists() else ""
    if ZOO_BEGIN in page:
        before, rest = page.split(ZOO_BEGIN, 1)
        after = rest.split(ZOO_END, 1)[1] if ZOO_END in rest else ""
        page = before + section + after.lstrip("\n")
    else:
        page = page.rstrip() + "\n\n" + section
    args.output.write_text(page)
    print(f"{args.output}: {len(outcomes)} zoo cells", file=sys.stderr)


if __name__ == "__main__":
    main()
