"""``plan --plot FILE``: each layout's memory per device as a chart (issue 39)."""

from __future__ import annotations

import sys

import pytest

from lightning_disttrain.cli import main

PLAN = ["plan", "--model", "gpt2-124m", "--gpu", "H100 SXM", "--gpus-per-node", "8", "--seq-len", "1024",
        "--global-batch", "64"]


def test_plot_draws_every_layout_of_the_table_with_its_parts_and_the_limits(tmp_path, capsys):
    import json

    out = tmp_path / "plan.svg"
    main([*PLAN, "--plot", str(out), "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["plot"] == str(out)
    svg = out.read_text()
    names = [x["name"] for x in plan["layouts"]]
    assert len(names) > 3
    for name in names:  # every layout of the table is a bar of the chart
        assert name in svg, name
    assert f"&gt; {plan['recommendation']}" in svg  # marked as in the table
    for label in ("parameters", "gradients", "optimizer state", "activations", "logits", "buffers",
                  "device memory", "usable (90% of the device)", "gpt2-124m"):
        assert label in svg, label


def test_plot_writes_a_png_too(tmp_path, capsys):
    out = tmp_path / "plan.png"
    main([*PLAN, "--plot", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("name, words", [("plan.txt", "name a .png, .svg, .pdf file"),
                                         ("missing/plan.png", "does not exist")])
def test_a_bad_plot_file_is_one_error_before_planning(tmp_path, capsys, name, words):
    with pytest.raises(SystemExit) as exit_:
        main([*PLAN, "--plot", str(tmp_path / name)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan: --plot") and words in err[0], err


def test_without_matplotlib_plot_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a bare install: import fails
    with pytest.raises(SystemExit) as exit_:
        main([*PLAN, "--plot", str(tmp_path / "plan.png")])
    assert exit_.value.code == 2
    assert "pip install 'lightning-disttrain[plot]'" in capsys.readouterr().err

