"""benchmarks/ablations.py's table: statistics over seeds and the README rewrite between markers."""

from __future__ import annotations

import pytest

from benchmarks import ablations


def test_summary_is_mean_and_sample_standard_deviation_over_seeds():
    table = ablations.summarise({"cross": [{"linear": 0.5}, {"linear": 0.7}, {"linear": 0.6}], "n1": [{"linear": 0.4}]})
    assert table["cross"]["linear"] == pytest.approx([0.6, 0.1])
    assert table["n1"]["linear"] == [0.4, 0.0]


def test_readme_table_is_written_between_the_markers_only(tmp_path):
    table = ablations.summarise({"none": [{"linear": 0.5, "ratio": 1.0}, {"linear": 0.6, "ratio": 1.0}]})
    text = ablations.markdown(table, {"none": 2}, 300, {"steps": 1000, "colour_from_where": 0.3})
    assert "| none | 2 | 0.550 ± 0.071 |" in text and "| variant | seeds | linear | true/shuffled |" in text
    readme = tmp_path / "README.md"
    begin, end = ablations.markers("ablations")
    other_begin, other_end = ablations.markers("short")
    readme.write_text(f"intro\n{begin}\nold table\n{end}\nmiddle\n{other_begin}\nold\n{other_end}\noutro\n")
    ablations.write_readme(readme, text)
    assert readme.read_text() == f"intro\n{begin}\n{text}\n{end}\nmiddle\n{other_begin}\nold\n{other_end}\noutro\n"
    ablations.write_readme(readme, "short table", "short")
    assert (
        readme.read_text() == f"intro\n{begin}\n{text}\n{end}\nmiddle\n{other_begin}\nshort table\n{other_end}\noutro\n"
    )
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        ablations.write_readme(readme, text)
