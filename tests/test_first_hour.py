"""A new user's first hour (issue 28): a bare install's imports are declared, nothing a user runs
points into ../shared, the CLI's expected failures are one short line naming the fix, `plan` says
when and how nothing fits, `eval` works with its defaults, HF exports are world-readable.

The CLI cases that start a run (fit, eval), and one parser error, run the real command in a
subprocess, as a user does; the other parser, export and plan errors call the same entry point
(``lightning_disttrain.cli.main``) in this process (``_run_here``: same output and exit status,
without ~4 s of interpreter and Lightning start-up each). Warnings a fresh interpreter prints on
import are checked by tests/test_cli_errors.py::test_help_prints_no_warnings."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_disttrain"
TRACEBACK = "Traceback (most recent call last)"

# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml", "lightning_utilities": "lightning-utilities", "typing_extensions": "typing-extensions",
        "huggingface_hub": "huggingface-hub", "jsonargparse": "jsonargparse"}


def _run(cwd: Path, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LDT_TRACEBACK", "LDT_DEBUG")} | (env or {})
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-m", "lightning_disttrain.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _run_here(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``lightning-disttrain ARGS`` through ``cli.main`` in this process, in ``cwd``: its exit
    status (an uncaught exception is not caught: the test fails with it), stdout and stderr."""
    from lightning_disttrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        for var in ("LDT_TRACEBACK", "LDT_DEBUG"):
            mp.delenv(var, raising=False)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(["lightning-disttrain", *args], code, out.getvalue(), err.getvalue())


def _out(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def _short_error(result: subprocess.CompletedProcess, max_lines: int = 4) -> str:
    """The error text of a failed command: no traceback, a few lines at most."""
    assert result.returncode != 0, _out(result)[-3000:]
    assert TRACEBACK not in _out(result), _out(result)[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if "error" in line.lower())
    assert len(lines) - start <= max_lines, result.stderr[-3000:]
    return "\n".join(lines[start:])


# ---- 2. dependencies -----------------------------------------------------------------------------


OPTIONAL = {"torchft": "ft", "matplotlib": "plot"}
"""Imports allowed outside [project].dependencies: declared in that extra, and only inside functions
(the feature's code path; a bare install imports every module without them). torchft has wheels
for Linux x86_64 only, so it cannot be a dependency of every install; matplotlib draws only
``plan --plot`` (and some 40 MB of wheels a training job does not need)."""


def _names(pyproject: dict, key: str | None) -> set[str]:
    reqs = pyproject["project"]["dependencies"] if key is None else pyproject["project"]["optional-dependencies"][key]
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-") for req in reqs}


def test_every_third_party_import_is_a_declared_dependency():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = _names(pyproject, None)
    imported: dict[str, str] = {}
    top_level: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "lightning_disttrain":
                    imported.setdefault(top, str(path.relative_to(REPO)))
                    if id(node) not in in_functions:
                        top_level.setdefault(top, str(path.relative_to(REPO)))
    missing = {top: where for top, where in imported.items()
               if DIST.get(top, top).lower().replace("_", "-") not in declared and top not in OPTIONAL}
    assert not missing, f"imported but not in [project].dependencies: {missing}"
    for top, extra in OPTIONAL.items():
        assert top in _names(pyproject, extra), f"{top} is not declared in the [{extra}] extra"
        assert top not in top_level, f"{top} (the [{extra}] extra) is imported at module level in {top_level[top]}"


# ---- 3. no ../shared in what a user runs ---------------------------------------------------------


def test_configs_and_readme_do_not_point_into_shared():
    for path in [REPO / "README.md", *sorted((REPO / "configs").glob("*.yaml"))]:
        assert "../shared" not in path.read_text(), path
    assert (REPO / "docs" / "architecture.md").is_file()


def test_bundled_eval_samples_ship_with_the_package():
    from lightning_disttrain.evals.tasks import KNOWN_TASKS, SAMPLES_DIR, load_task

    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "evals/samples/*" in package_data["lightning_disttrain"]
    config = yaml.safe_load((REPO / "configs" / "evals.yaml").read_text())
    (evals,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("CheckpointEval")]
    assert evals["init_args"]["data_dir"] == "bundled"
    for name in evals["init_args"]["tasks"]:
        if name != "heldout":
            task = load_task(name, "bundled", evals["init_args"]["limit"])
            assert Path(task.source).parent == SAMPLES_DIR and len(task.items) == evals["init_args"]["limit"]
    assert all((SAMPLES_DIR / KNOWN_TASKS[t].file).is_file() for t in ("piqa", "lambada_openai", "copa"))


# ---- 4. errors: one short line that names the fix ------------------------------------------------


def _config(tmp_path: Path, **trainer) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "limit_val_batches": 0, "default_root_dir": str(tmp_path),
                    **trainer},
        "model": {"class_path": "lightning_disttrain.GPTModule", "init_args": {"config": "tiny"}},
        "data": {"class_path": "lightning_disttrain.TokenDataModule",
                 "init_args": {"source": "embedded", "tokenizer": "bytes", "seq_len": 32, "batch_size": 4,
                               "val_batches": 0, "max_docs": 60, "num_proc": 1, "cache_dir": str(tmp_path / "cache")}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_unknown_yaml_key_is_one_line_with_did_you_mean(tmp_path):
    path = _config(tmp_path)
    path.write_text(path.read_text().replace("max_steps:", "max_stepz:"))
    text = _short_error(_run_here(tmp_path, "fit", "--config", str(path)), max_lines=2)
    assert "trainer.max_stepz" in text and "did you mean 'trainer.max_steps'" in text


def test_misspelt_class_path_is_one_line_with_did_you_mean(tmp_path):
    path = _config(tmp_path)
    path.write_text(path.read_text().replace("lightning_disttrain.GPTModule", "lightning_disttrain.GPTModul"))
    text = _short_error(_run_here(tmp_path, "fit", "--config", str(path)), max_lines=2)
    assert "did you mean 'lightning_disttrain.GPTModule'" in text


def test_unknown_strategy_name_suggests_ours(tmp_path):
    out = _run(tmp_path, "fit", "--config", str(_config(tmp_path)), "--trainer.strategy", "fsdp3", timeout=120)
    text = _short_error(out, max_lines=1)
    assert "did you mean 'fsdp2'" in text and "fsdp2_tp" in text


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path):
    text = _short_error(_run_here(tmp_path, "export", str(tmp_path / "nope"), "out.pt"))
    assert text.startswith("error: export: ") and "does not exist" in text


def test_export_of_a_corrupt_checkpoint_is_one_line(tmp_path):
    (tmp_path / "bad.ckpt").mkdir()
    (tmp_path / "bad.ckpt" / "manifest.json").write_text("{not json")
    text = _short_error(_run_here(tmp_path, "export", "bad.ckpt", "out.pt"))
    assert text.startswith("error: export: ") and "malformed" in text


def test_fit_from_a_corrupt_checkpoint_has_no_traceback(tmp_path):
    (tmp_path / "bad.ckpt").mkdir()
    (tmp_path / "bad.ckpt" / "manifest.json").write_text("{not json")
    out = _run(tmp_path, "fit", "--config", str(_config(tmp_path, strategy="fsdp2")), "--ckpt_path", "bad.ckpt")
    text = _short_error(out, max_lines=2)
    assert "malformed" in text and "LDT_TRACEBACK=1" in text


# ---- 5. plan: non-zero when nothing fits, and what would ---------------------------------------


def test_plan_when_nothing_fits_says_how_many_gpus_would(tmp_path):
    out = _run_here(tmp_path, "plan", "--model", "llama3-70b", "--gpu", "H100 SXM", "--nodes", "1")
    assert out.returncode == 1, _out(out)[-3000:]
    assert "smallest cluster that fits" in out.stderr and "--nodes 4" in out.stderr
    assert "add GPUs, or shorten" not in _out(out)


def test_plan_says_when_no_gpu_count_fits(capsys):
    from lightning_disttrain.planning.command import plan_main

    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "llama3-70b", "--seq-len", "1000000"])
    assert exit_.value.code == 1
    assert "cannot fit on H100 SXM (80 GB) whatever the batch" in capsys.readouterr().err


def test_plan_assumptions_include_bytes_per_parameter(capsys):
    from lightning_disttrain.planning.command import plan_main

    plan_main(["--model", "gpt2-124m", "--json"])
    import json

    plan = json.loads(capsys.readouterr().out)
    assert any("16 bytes/param" in a for a in plan["assumptions"]), plan["assumptions"]


# ---- eval defaults, export and HF file modes, on one short run --------------------------------------


@pytest.fixture(scope="session")  # not "module": the suite runs this module's slow test in a later group
def checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": 2, "save_last": "link"}}]
    out = _run(tmp, "fit", "--config", str(_config(tmp, strategy="fsdp2", callbacks=callbacks,
                                                    enable_progress_bar=True)))
    assert out.returncode == 0, _out(out)[-3000:]
    assert (tmp / "ckpt" / "last.ckpt").exists()
    (tmp / "fit.out").write_text(_out(out))
    return tmp / "ckpt" / "last.ckpt"


def test_progress_bar_under_max_steps_says_epoch_0(checkpoint):
    # Finding 7: with max_steps, Lightning's rich bar printed "Epoch 0/-2".
    text = (checkpoint.parent.parent / "fit.out").read_text()
    assert re.search(r"Epoch 0 +━", text) and "Epoch 0/-2" not in text, text[-2000:]


def test_eval_with_its_defaults_scores_an_exported_file(checkpoint, tmp_path):
    out = _run(tmp_path, "export", str(checkpoint), "model.pt")
    assert out.returncode == 0, _out(out)[-3000:]
    out = _run(tmp_path, "eval", "model.pt", "--limit", "4", "--output", "r.json")
    assert out.returncode == 0, _out(out)[-3000:]
    assert "step None" not in _out(out) and "evals (model.pt)" in _out(out)
    import json

    metrics = json.loads((tmp_path / "r.json").read_text())["metrics"]
    assert {"lambada_openai", "piqa", "arc_easy", "winogrande", "copa"} <= set(metrics)


@pytest.mark.slow  # 2 processes
def test_eval_heldout_without_a_corpus_is_one_error_on_two_devices(checkpoint, tmp_path):
    out = _run(tmp_path, "eval", str(checkpoint), "--tasks", "heldout", "--devices", "2", timeout=180)
    text = _short_error(out, max_lines=1)
    assert "--heldout FILE" in text and text.count("error") == 1


def test_hf_export_is_world_readable(checkpoint, tmp_path):
    out = _run(tmp_path, "export", str(checkpoint), "hf", "--format", "hf")
    assert out.returncode == 0, _out(out)[-3000:]
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "hf" / name).stat().st_mode) == 0o666 & ~umask, name


def test_resume_from_a_directory_without_checkpoints_does_not_point_at_warnings_that_never_came(tmp_path):
    # Finding 7: "see the warnings above" was printed when the directory held nothing to warn about.
    from lightning_disttrain.checkpoint.dcp_io import Comm
    from lightning_disttrain.strategies import NDParallelStrategy

    with pytest.raises(ValueError, match="holds no checkpoint at all") as info:
        NDParallelStrategy()._resolve_checkpoint(tmp_path / "last.ckpt", Comm())
    assert "warnings above" not in str(info.value)


# ---- a normal run prints nothing that reads wrong (issue 42, item 7) --------------------------------------

NOISE = {
    "litlogger": "Lightning's litlogger tip",
    "FLOPs ┃": "the model summary's FLOPs column of zeros",
    "Total FLOPs": "the model summary's total FLOPs, 0",
    "v_num": "the logger's version on the bar",
    "weights_only": "`weights_only` was not set",
    "was configured": "`Trainer(limit_val_batches=1)` was configured (eval)",
    "Epoch 0/-2": "the rich bar's epoch count under max_steps",
    "FSDP over 1 ranks": "expert parallel's start-up line",
    "returned a view tensor": "torch's FSDP2 view warning",
    "tensorboardX": "Lightning's default logger's warning",
}


@pytest.mark.slow  # one fit and one eval, 1 process each
def test_fit_of_the_planned_config_and_eval_print_no_noise(tmp_path):
    # The YAML `plan --write-config` writes for `tiny` on one CPU (DDP x1, Lightning's ddp strategy: the
    # Epoch 0/-2 the strategies of this package fixed only for themselves), run with the bar and the
    # model summary on, a checkpoint, then `eval` of it with its defaults.
    plan = _run_here(tmp_path, "plan", "--model", "tiny", "--override", "vocab_size=257", "--gpu", "cpu",
                     "--gpu-memory", "1", "--gpus-per-node", "1", "--seq-len", "64", "--global-batch", "8",
                     "--micro-batch", "4", "--precision", "fp32", "--write-config", "plan.yaml")
    assert plan.returncode == 0, _out(plan)[-3000:]
    config = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert config["trainer"]["strategy"] == "ddp"
    config["trainer"]["max_steps"] = 4
    config["trainer"]["callbacks"][-1]["init_args"]["every_n_train_steps"] = 2
    config["data"]["init_args"].update(source="embedded", max_docs=60, num_proc=1, cache_dir="cache")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    fit = _run(tmp_path, "fit", "--config", "run.yaml", env={"COLUMNS": "200"})
    assert fit.returncode == 0, _out(fit)[-3000:]
    assert re.search(r"Epoch 0 +━", _out(fit)) and "Total params" in _out(fit), _out(fit)[-3000:]
    ckpt = tmp_path / "runs" / "planned" / "checkpoints" / "last.ckpt"
    evaluated = _run(tmp_path, "eval", str(ckpt), "--limit", "2", env={"COLUMNS": "200"})
    assert evaluated.returncode == 0 and "piqa" in _out(evaluated), _out(evaluated)[-3000:]
    for name, out in (("fit", fit), ("eval", evaluated)):
        found = [why for word, why in NOISE.items() if word in _out(out)]
        assert not found, f"{name}: {found}\n{_out(out)[-3000:]}"
