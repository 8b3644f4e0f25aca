"""The HTML report is one self-contained file with the diagnosis, plots and tables."""

import re

from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.events import load
from shardflow.profile.report import write_report


def test_report_is_self_contained_html_with_plots_and_the_diagnosis(fixture_model_dir, tmp_path):
    table = load(finalize(capture_dir(fixture_model_dir)))
    text = write_report(table, tmp_path / "report.html").read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", text)
    assert len(re.findall(r'<img alt="plot" src="data:image/png;base64,', text)) == 3
    assert "compute-bound: forward and backward take 60% of each step" in text
    assert "aten::addmm" in text and "152.0 MB" in text
