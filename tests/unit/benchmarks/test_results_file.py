"""A benchmark run rewrites its own sections of RESULTS.md and keeps every line added by hand.

Before, `python -m benchmarks run --only NAME` rendered RESULTS.md from results.json alone: the
sections measured by hand (verify_cost, training_patterns, ...) and the notes and reruns added
inside generated sections (half of the file, 67 of 139 KB) would have been dropped.
"""

from benchmarks.__main__ import KEPT, render, updated
from benchmarks.common import results_section


def result(markdown: str) -> dict:
    return {"command": "python -m benchmarks run", "machine": "x86_64", "date": "2026-12-06", "markdown": markdown}


def test_a_section_as_generated_is_replaced_in_place_and_hand_sections_stay():
    old = {"alpha": result("| a | 1 |"), "beta": result("| b | 2 |")}
    text = render(old) + "\n## training_patterns\n\nMeasured by hand: 1.8e-3.\n"
    new = updated(text, "alpha", old["alpha"], result("| a | 3 |"))
    assert "| a | 3 |" in new and "| a | 1 |" not in new
    assert "| b | 2 |" in new and "Measured by hand: 1.8e-3." in new and KEPT not in new
    assert new.index("## alpha") < new.index("## beta") < new.index("## training_patterns")


def test_notes_after_a_generated_section_stay_after_it():
    old = {"alpha": result("| a | 1 |"), "beta": result("| b | 2 |")}
    text = render(old).replace("| a | 1 |", "| a | 1 |\n\nRerun by hand: 0.26.")
    new = updated(text, "alpha", old["alpha"], result("| a | 3 |"))
    assert new.index("| a | 3 |") < new.index("Rerun by hand: 0.26.") < new.index("## beta")
    assert "| a | 1 |" not in new and KEPT not in new


def test_a_section_edited_by_hand_keeps_its_text_under_the_new_one():
    old = {"alpha": result("| a | 1 |"), "beta": result("| b | 2 |")}
    text = render(old).replace("| a | 1 |", "| a | 1.0 (corrected by hand) |")
    new = updated(text, "alpha", old["alpha"], result("| a | 3 |"))
    assert new.index("| a | 3 |") < new.index(KEPT) < new.index("| a | 1.0 (corrected by hand) |")
    assert new.count("## alpha") == 1 and new.index(KEPT) < new.index("## beta")
    again = updated(new, "alpha", result("| a | 3 |"), result("| a | 4 |"))  # the next run: in place
    assert "| a | 4 |" in again and "| a | 3 |" not in again and "(corrected by hand)" in again


def test_a_new_section_is_added_at_the_end():
    text = "\n".join(results_section("alpha", result("| a | 1 |")))
    new = updated(text, "gamma", None, result("| c | 5 |"))
    assert new.startswith(text.rstrip("\n")) and new.rstrip().endswith("| c | 5 |")
