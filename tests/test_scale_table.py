"""The scale table in docs/diloco.md is what benchmarks/scale_table.py computes, and it shows
what issue 17 asks of it: a 1B model on a 16 GB GPU over a 10/50 Mbit/s link at 90% compute use."""

from pathlib import Path

from benchmarks import scale_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "diloco.md"


def test_the_docs_hold_the_table_the_formulas_give():
    assert scale_table.markdown() in DOC.read_text(), "docs/diloco.md: rerun python -m benchmarks.scale_table"


def test_a_1b_volunteer_fits_a_16_gb_gpu_and_computes_90_percent_of_the_time_on_a_household_link():
    for volunteers in scale_table.VOLUNTEERS:
        r = scale_table.row("1B", volunteers, "10/50")
        assert r["gpu_GB"] <= 16
        assert r["compute_use"] >= 0.9
        assert r["up_MB"] * 1e6 / r["n_params"] <= 0.05  # SparseLoCo's budget, per volunteer per round
        assert r["round_s"] == max(r["compute_s"], r["up_s"] + r["aggregate_s"] + r["down_s"])
    assert scale_table.row("1B", 40, "10/50")["compute_use_without_overlap"] >= 0.9
    assert scale_table.row("7B", 40, "10/50")["gpu_GB"] > 16  # a 7B volunteer needs a larger GPU
