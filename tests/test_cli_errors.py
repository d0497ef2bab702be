"""What the command prints when something fails: one line naming the cause, printed once and last.

The multi-process tests run the real command with 2 CPU ranks (gloo), launched the way a user
launches it: Lightning's subprocess launcher re-runs the command for rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_disttrain.cli import DistTrainCLI

TESTS = Path(__file__).resolve().parent
NOISE = ("Union subtypes", "Connection closed by peer", "Traceback", "sync_dist=True", "LeafSpec",
         "args parameter is intended")


def _config(tmp_path: Path, devices: int = 1, callbacks: list | None = None, strategy=None, data: dict | None = None,
            max_steps: int = 2) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": devices, "max_steps": max_steps, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path), "val_check_interval": max_steps,
                    "check_val_every_n_epoch": None, "limit_val_batches": 2, "callbacks": callbacks or []},
        "model": {"class_path": "lightning_disttrain.GPTModule", "init_args": {"config": "tiny"}},
        "data": {"class_path": "lightning_disttrain.TokenDataModule",
                 "init_args": {"source": "embedded", "tokenizer": "bytes", "seq_len": 32, "batch_size": 4,
                               "val_batches": 2, "max_docs": 60, "num_proc": 1, "cache_dir": str(tmp_path / "cache"),
                               **(data or {})}},
    }
    if strategy is not None:
        config["trainer"]["strategy"] = strategy
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LDT_TRACEBACK"} | (env or {})
    # rank_failure.FailOnRank is importable by class_path in the command and the rank it launches.
    env |= {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "lightning_disttrain.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False, timeout=timeout)


def _lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


# ---- configuration errors: the class's own message, with its config key --------------------------------


def _config_error(tmp_path, capsys, **config) -> str:
    with pytest.raises(SystemExit) as info:
        DistTrainCLI(args=["fit", "--config", str(_config(tmp_path, **config))])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert not any(noise in err for noise in NOISE[:3]), err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


def test_unknown_tokenizer_is_one_line(tmp_path, capsys):
    line = _config_error(tmp_path, capsys, data={"tokenizer": "gpt3"})
    assert line == "error: data: unknown tokenizer 'gpt3'; choose one of gpt2, r50k_base, bytes."


def test_a_bad_strategy_degree_names_the_key(tmp_path, capsys):
    strategy = {"class_path": "lightning_disttrain.strategies.NDParallelStrategy", "init_args": {"cp": 0}}
    line = _config_error(tmp_path, capsys, strategy=strategy)
    assert line.startswith("error: trainer.strategy: NDParallelStrategy(cp=0): a parallel degree is an int >= 1")


def test_callback_error_names_its_list_position(tmp_path, capsys):
    callbacks = [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
                 {"class_path": "rank_failure.FailOnRank", "init_args": {"hook": "epoch"}}]
    line = _config_error(tmp_path, capsys, callbacks=callbacks)
    assert line == "error: trainer.callbacks[1]: hook='epoch': use 'setup' or 'step'"


def test_misspelt_source_is_a_config_error(tmp_path, capsys):
    line = _config_error(tmp_path, capsys, data={"source": "embeded"})
    assert line.startswith("error: data: source 'embeded' is not a keyword") and "did you mean source='embedded'" in line


# ---- no alarming warnings on a normal run ------------------------------------------------------------


def test_help_prints_no_warnings(tmp_path):
    out = _run(tmp_path, "fit", "--help", timeout=120)
    assert out.returncode == 0 and "--trainer" in out.stdout
    assert not [n for n in NOISE if n in out.stderr] and "warn" not in out.stderr.lower(), out.stderr[-3000:]


@pytest.mark.slow
def test_two_rank_fit_prints_no_alarming_warnings(tmp_path):
    out = _run(tmp_path, "fit", "--config", str(_config(tmp_path, devices=2, strategy="fsdp2", max_steps=2)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [n for n in NOISE if n in out.stdout + out.stderr], out.stderr[-3000:]


# ---- errors in a 2-rank run: the real one, once, last --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fail, expected_last", [
    # rank 0 waits in a collective for rank 1, which raised: formerly its gloo error came last.
    ({"rank": 1, "message": "only rank 1 fails"}, "lightning-disttrain: error on rank 1: ValueError: only rank 1 fails"),
    # a data error hits every rank: formerly printed once per rank.
    ({"rank": -1, "message": "every rank fails"},
     "lightning-disttrain: error on ranks 0, 1: ValueError: every rank fails"),
    # mid-training on rank 0, not a ValueError: its traceback is shown, once, above the summary.
    ({"rank": 0, "hook": "step", "message": "rank 0 breaks at step 1", "error": "RuntimeError"},
     "lightning-disttrain: error on rank 0: RuntimeError: rank 0 breaks at step 1"),
])
def test_two_rank_failure_is_reported_once_and_last(tmp_path, fail, expected_last):
    callbacks = [{"class_path": "rank_failure.FailOnRank", "init_args": fail}]
    out = _run(tmp_path, "fit", "--config", str(_config(tmp_path, devices=2, strategy="fsdp2", callbacks=callbacks,
                                                         max_steps=4)))
    lines = _lines(out)
    everything = out.stdout + out.stderr
    assert out.returncode == 1, everything[-4000:]
    assert lines[-1] == expected_last, everything[-4000:]
    assert everything.count(fail["message"]) == (2 if fail.get("error") == "RuntimeError" else 1), everything[-4000:]
    assert "Connection closed" not in everything and "Connection reset" not in everything, everything[-4000:]
    assert everything.count("Traceback") == (1 if fail.get("error") == "RuntimeError" else 0), everything[-4000:]


def test_traceback_on_request(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LDT_TRACEBACK", "1")
    with pytest.raises(SystemExit):
        DistTrainCLI(args=["fit", "--config", str(_config(tmp_path, data={"tokenizer": "gpt3"}))])
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "in canonical_tokenizer_name" in err
    assert [line for line in err.splitlines() if line.strip()][-1].startswith("error: data: unknown tokenizer")


# ---- a misspelt key or class, on the command line or in YAML: one line naming it, "did you mean" --------


def _parse_error(tmp_path, capsys, *args: str, yaml_edit: tuple[str, str] | None = None, **config) -> str:
    """``lightning-disttrain fit --config run.yaml ARGS`` through ``cli.main`` (the command's entry
    point) in this process, parsing only (``--print_config``): exit status 2, one ``error:`` line."""
    from lightning_disttrain.cli import main

    path = _config(tmp_path, **config)
    if yaml_edit is not None:
        assert yaml_edit[0] in path.read_text()
        path.write_text(path.read_text().replace(*yaml_edit, 1))
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(path), *args, "--print_config"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len([line for line in err.splitlines() if line.strip()]) <= 2, err
    assert "more lines with" not in err and "Traceback" not in err, err
    return errors[0]


CALLBACKS = [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
             {"class_path": "rank_failure.FailOnRank", "init_args": {"hook": "step"}}]


@pytest.mark.parametrize("args, yaml_edit, key, suggestion", [
    (["--model.init_args.lrr", "1e-3"], None, "model.init_args.lrr", "model.init_args.lr"),
    ([], ("config: tiny", "config: tiny\n    lrr: 0.001"), "model.init_args.lrr", "model.init_args.lr"),
    ([], ("seq_len:", "seq_lenn:"), "data.init_args.seq_lenn", "data.init_args.seq_len"),
    ([], ("hook: step", "hookk: step"), "trainer.callbacks[1].init_args.hookk", "trainer.callbacks[1].init_args.hook"),
    (["--model", "lightning_disttrain.GPTModul"], None, "model: class_path 'lightning_disttrain.GPTModul'",
     "lightning_disttrain.GPTModule"),
    (["--model", "GPTModul"], None, "model: class_path 'GPTModul'", "lightning_disttrain.GPTModule"),
    (["--trainer.max_stpes", "4"], None, "unrecognized option --trainer.max_stpes", "--trainer.max_steps"),
    ([], ("trainer:", "trainr:"), "trainr", "trainer"),
])
def test_misspelt_key_is_one_line_with_did_you_mean(tmp_path, capsys, args, yaml_edit, key, suggestion):
    line = _parse_error(tmp_path, capsys, *args, yaml_edit=yaml_edit, callbacks=CALLBACKS)
    assert line.startswith(f"error: {key}"), line
    assert f"did you mean '{suggestion}'?" in line, line


def test_an_option_prefix_is_not_taken_for_the_option(tmp_path, capsys):
    # argparse's allow_abbrev took --trainer.max_step as --trainer.max_steps, silently
    line = _parse_error(tmp_path, capsys, "--trainer.max_step", "4")
    assert line.startswith("error: unrecognized option --trainer.max_step;") and "'--trainer.max_steps'" in line


def test_misspelt_init_args_key_on_the_command_line_is_one_line(tmp_path):
    out = _run(tmp_path, "fit", "--config", str(_config(tmp_path)), "--model.init_args.lrr", "1e-3", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in _lines(out) if "error" in line.lower()]
    assert errors == ["error: model.init_args.lrr: GPTModule has no option 'lrr'; did you mean 'model.init_args.lr'?"], \
        out.stderr[-3000:]
    assert len(_lines(out)) <= 2, out.stderr[-3000:]
