import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args, cwd, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "lightning_disttrain.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("config", ["quickstart.yaml", "gpt2-124m-fineweb.yaml"])
def test_shipped_configs_parse(config, capsys):
    from lightning_disttrain.cli import main  # in this process: `lightning-disttrain fit ... --print_config`

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(REPO / "configs" / config), "--print_config"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None), out[-3000:]
    assert "lightning_disttrain.GPTModule" in out
    assert "strategy: fsdp2" in out


# The shipped parallel configs, shortened, in the suite's shared 2-rank launch (tests/conftest.py,
# tests/strategies/config_worker.py): 2 processes, validation, a sharded checkpoint, the sample.
WORKER = "config_worker"
PARALLEL_CONFIGS = {
    "tensor-parallel": ("tensor_parallel: tp=2, 4 blocks + root, sequence parallel, loss parallel", "tp"),
    "pipeline-parallel": ("pipeline: 1F1B, 2 stages of 4 blocks [2, 2], 4 micro-batches; this rank: stage 0 "
                          "(blocks 0-1)", "pp"),
    "expert-parallel": ("expert_parallel: ep=2, 3 MoE layers, experts not FSDP-sharded", "ep"),
    "context-parallel": ("context_parallel: cp=2, 4 attention layers run ring attention, load-balanced chunks", "cp"),
}
LAUNCH = {2: [*PARALLEL_CONFIGS, "muon-clip"]}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(PARALLEL_CONFIGS))
def test_parallel_configs_train_on_two_cpu_ranks(launched, config):
    layout, dim = PARALLEL_CONFIGS[config]
    rank0 = launched(WORKER, 2)[config][0]
    assert rank0["steps"] == 4
    text = "\n".join(rank0["log"] + rank0["layout"])
    assert layout in text
    assert "----- sample at step 4 -----" in text
    runs = Path(rank0["runs"])
    rows = list(csv.DictReader(open(next((runs / "logs").glob("version_*/metrics.csv")))))
    assert any(r.get("val/loss") for r in rows) and any(r.get("train/loss") for r in rows)
    if dim == "ep":  # load balance per MoE layer through the Trainer's logger
        for i in (1, 2, 3):
            assert any(r.get(f"moe/layer{i}/max_load_ratio") for r in rows)
            assert any(r.get(f"moe/layer{i}/bias_norm") for r in rows)
    from lightning_disttrain.checkpoint import verify_checkpoint

    manifest = verify_checkpoint(runs / "checkpoints" / "last.ckpt")  # sharded, complete
    assert manifest.global_step == 4 and manifest.extra["parallel_dims"][dim] == 2


@pytest.mark.slow
def test_the_muon_clip_config_trains_with_muon_and_logs_the_largest_logit(launched):
    rank0 = launched(WORKER, 2)["muon-clip"][0]
    assert rank0["steps"] == 4
    runs = Path(rank0["runs"])
    rows = list(csv.DictReader(open(next((runs / "logs").glob("version_*/metrics.csv")))))
    logits = [float(r["attn/max_logit"]) for r in rows if r.get("attn/max_logit")]
    assert len(logits) == 2 and all(0 < x < 100 for x in logits)  # steps 2 and 4; tau=100 clips nothing here
    assert any(r.get("train/lr_muon") for r in rows)  # Muon's group, beside AdamW's train/lr
    from lightning_disttrain.checkpoint import verify_checkpoint

    assert verify_checkpoint(runs / "checkpoints" / "last.ckpt").global_step == 4


def test_cli_fit_from_yaml(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
seed_everything: 7
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  log_every_n_steps: 1
  val_check_interval: 3
  check_val_every_n_epoch: null
  enable_progress_bar: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path}, name: logs}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {tmp_path}/ckpt, every_n_train_steps: 6}}
    - class_path: lightning_disttrain.callbacks.SampleGeneration
      init_args: {{prompt: "def ", max_new_tokens: 8}}
model:
  class_path: lightning_disttrain.GPTModule
  init_args: {{config: tiny, lr: 1.0e-3}}
data:
  class_path: lightning_disttrain.TokenDataModule
  init_args: {{source: embedded, tokenizer: bytes, seq_len: 32, batch_size: 4, val_batches: 2,
               cache_dir: {tmp_path}/cache, max_docs: 60}}
""")
    out = _run(["fit", "--config", str(cfg)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "----- sample at step 6 -----" in out.stderr + out.stdout
    rows = list(csv.DictReader(open(next((tmp_path / "logs").glob("version_*/metrics.csv")))))
    assert any(r.get("val/loss") for r in rows) and any(r.get("train/loss") for r in rows)
    assert list((tmp_path / "ckpt").iterdir())


def test_cli_help_lists_tools(tmp_path, capsys):
    from lightning_disttrain.cli import main  # in this process (a fresh one: test_cli_errors.py)

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "prepare" in out and "export" in out and "plan" in out and "eval" in out

    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--help"])
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_only_the_named_lightning_subcommand_gets_a_parser(capsys, monkeypatch):
    """LightningCLI builds a whole parser (every Trainer argument, every class signature) per
    subcommand it offers: ``lightning-disttrain fit`` builds fit's alone; the top-level help and an
    unknown name still see all four."""
    from lightning_disttrain.cli import DistTrainCLI, main

    with pytest.raises(SystemExit) as exit_:
        DistTrainCLI(args=["fit", "--help"])  # the subcommand read from args
    assert exit_.value.code == 0 and "--trainer.max_steps" in capsys.readouterr().out
    built = []
    original = DistTrainCLI._prepare_subcommand_parser

    def spy(self, klass, subcommand, **kwargs):
        built.append(subcommand)
        return original(self, klass, subcommand, **kwargs)

    monkeypatch.setattr(DistTrainCLI, "_prepare_subcommand_parser", spy)  # LightningCLI's, per subcommand
    for argv in (["validate", "--help"], ["--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    with pytest.raises(SystemExit):  # parser_kwargs of other subcommands, as LightningCLI allows
        DistTrainCLI(args=["test", "--help"], parser_kwargs={"fit": {"description": "f"}, "test": {}})
    assert built == ["validate", "fit", "validate", "test", "predict", "test"]
    assert "{fit,validate,test,predict}" in capsys.readouterr().out
