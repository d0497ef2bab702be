"""Every YAML `plan --write-config` writes runs as written: one per layout class the planner
recommends (DDP, ZeRO-2, FSDP2, HSDP, TP, CP, TP + CP, PP 1F1B and interleaved, TP + PP of both schedules, EP,
with each checkpointing policy it offers), for a tiny model on a `cpu` cluster of 2-4 ranks, fitted 2 steps
through the CLI; and the strategy and the plan read the same schedule from one YAML.

The fits run inside the suite's shared 2- and 4-rank launches (tests/conftest.py) through
``DistTrainCLI``, the class behind ``lightning-disttrain fit --config``
(tests/planning/written_config_worker.py): one Python and Lightning start-up per world size instead
of one per YAML. They override only what a test machine needs: 2 steps, the embedded byte corpus instead of
the placeholder source, no validation set, and all ranks on this one host (``num_nodes: 1`` with
``devices`` = the cluster's world size: a 2 x 2 cluster runs as 4 local processes, the same mesh).
"""

from __future__ import annotations

import pytest
import yaml

from lightning_disttrain.cli import main
from lightning_disttrain.planning import (
    Cluster,
    Workload,
    config_for,
    make_plan,
    shape_of,
)
from lightning_disttrain.planning.config_yaml import (
    config_dict,
    find_candidate,
    layout_from_config,
)
from lightning_disttrain.planning.layouts import candidate_layouts
from lightning_disttrain.planning.memory import memory_per_gpu
from lightning_disttrain.planning.pipeline import inflight

GLOBAL_BATCH = 8
PLAN = ["--override", "vocab_size=257", "--gpu", "cpu", "--gpu-memory", "1", "--seq-len", "64",
        "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "2", "--precision", "fp32"]
"""The tiny workload: 8 sequences of 64 tokens per step, micro batch 2, fp32 (CPU): 4 micro-batches
per step on one data-parallel rank (gradient accumulation, or a pipeline's micro-batches), as few as
the interleaved schedule's 4 stages allow (a fit's time grows with them)."""

# (model, gpus per node, nodes, layout as the table names it, log line the strategy prints)
RUNS = {
    "ddp": ("tiny", 2, 1, "DDP x2", None),
    "zero2": ("tiny", 2, 1, "ZeRO-2 x2", "fsdp"),
    "fsdp2-selective": ("tiny", 2, 1, "FSDP2 x2 + AC selective", "activation_checkpointing"),
    "hsdp": ("tiny", 2, 2, "HSDP 2x2", "fsdp"),
    "tp-full": ("tiny", 2, 1, "FSDP2 x1 + TP 2 + AC full", "tensor_parallel"),
    "pp-1f1b": ("tiny", 1, 2, "FSDP2 x1 + PP 2 (1F1B, 4 mb) + AC selective",
                "pipeline: 1F1B, 2 stages of 4 blocks [2, 2], 4 micro-batches"),
    "pp-interleaved": ("tiny", 1, 2, "FSDP2 x1 + PP 2 (Interleaved1F1B v2, 4 mb)",
                       "pipeline: Interleaved1F1B, 4 stages of 4 blocks [1, 1, 1, 1], 4 micro-batches"),
    "tp-pp-1f1b": ("tiny", 2, 2, "FSDP2 x1 + TP 2 + PP 2 (1F1B, 4 mb)",
                   "pipeline: 1F1B, 2 stages of 4 blocks [2, 2], 4 micro-batches"),
    "tp-pp-interleaved": ("tiny", 2, 2, "FSDP2 x1 + TP 2 + PP 2 (Interleaved1F1B v2, 4 mb) + AC full",
                          "pipeline: Interleaved1F1B, 4 stages of 4 blocks [1, 1, 1, 1], 4 micro-batches"),
    "cp": ("tiny", 2, 1, "FSDP2 x1 + CP 2", "context_parallel: cp=2"),
    "tp-cp-selective": ("tiny", 4, 1, "FSDP2 x1 + TP 2 + CP 2 + AC selective", "context_parallel: cp=2"),
    "ep": ("tiny-moe", 2, 1, "FSDP2 x2 + EP 2", "expert_parallel: ep=2"),
    "ep-full": ("tiny-moe", 2, 1, "FSDP2 x2 + EP 2 + AC full", "expert_parallel: ep=2"),
    "ep-selective": ("tiny-moe", 2, 1, "FSDP2 x2 + EP 2 + AC selective", "activation_checkpointing"),
}


def _kind(layout) -> tuple:
    """A layout's class: ZeRO stage, HSDP, TP, pipeline schedule, EP."""
    return (layout.zero, layout.dp_replicate > 1 and layout.zero > 0, layout.tp > 1, layout.cp > 1,
            layout.pipeline.schedule if layout.pp > 1 else None, layout.ep > 1)


def plan_args(model, gpus, nodes):
    return ["plan", "--model", model, *PLAN, "--gpus-per-node", str(gpus), "--nodes", str(nodes)]


def _written(tmp_path, name, capsys) -> tuple[dict, str]:
    model, gpus, nodes, layout, _ = RUNS[name]
    path = tmp_path / f"{name}.yaml"
    main([*plan_args(model, gpus, nodes), "--write-config", str(path), "--layout", layout])
    assert f"wrote {path}" in capsys.readouterr().out
    return yaml.safe_load(path.read_text()), str(path)


def test_the_runs_cover_every_class_the_planner_offers():
    tested = set()
    for model, gpus, nodes, name, _ in RUNS.values():
        shape = shape_of(config_for(model, {"vocab_size": 257}), 64)
        plan = make_plan(shape, Workload(64, GLOBAL_BATCH, 2, "fp32"), Cluster("cpu", gpus, nodes, 1.0))
        tested.add(_kind(find_candidate(plan, name).layout))
    for model, gpus, nodes, *_ in RUNS.values():
        shape = shape_of(config_for(model, {"vocab_size": 257}), 64)
        for layout, _, ok in candidate_layouts(shape, Cluster("cpu", gpus, nodes, 1.0), Workload(64, GLOBAL_BATCH, 2, "fp32")):
            assert not ok or _kind(layout) in tested, f"{layout.name}: a class no run below fits"


@pytest.mark.parametrize("name", ["pp-interleaved", "tp-pp-1f1b"])
def test_strategy_and_plan_read_one_schedule_from_the_yaml(tmp_path, capsys, name):
    from lightning_disttrain.strategies import NDParallelStrategy

    config, _ = _written(tmp_path, name, capsys)
    strategy = NDParallelStrategy(**config["trainer"]["strategy"]["init_args"])
    layout, batch = layout_from_config(config)
    assert layout.pipeline == strategy.pp_options  # schedule, micro-batches, stages per rank, split
    assert layout.name == RUNS[name][3]
    options, pp = strategy.pp_options, layout.pp
    assert batch == 2 * options.num_microbatches(pp)  # the data module's batch splits into the micro-batches
    options.validate(pp, n_blocks=4, batch_size=batch)  # what the strategy checks before the first step
    assert [inflight(options, pp, r) for r in range(pp)] == [inflight(layout.pipeline, pp, r) for r in range(pp)]
    # the plan of the YAML's layout is the one the table printed for it
    model, gpus, nodes, *_ = RUNS[name]
    shape = shape_of(config_for(model, {"vocab_size": 257}), 64)
    workload, cluster = Workload(64, GLOBAL_BATCH, 2, "fp32"), Cluster("cpu", gpus, nodes, 1.0)
    printed = find_candidate(make_plan(shape, workload, cluster), layout.name)
    assert memory_per_gpu(shape, layout, workload, cluster) == printed.memory


def test_every_written_pipeline_carries_its_schedule(capsys):
    shape = shape_of(config_for("tiny", {"vocab_size": 257}), 64)
    plan = make_plan(shape, Workload(64, GLOBAL_BATCH, 2, "fp32"), Cluster("cpu", 2, 2, 1.0))
    for c in plan.candidates:
        if c.layout.pp > 1 and c.recommendable:
            init = config_dict(plan, "tiny", {}, c)["trainer"]["strategy"]["init_args"]
            assert init["pp_schedule"] == c.layout.pipeline.schedule
            assert init["pp_microbatches"] == c.layout.microbatches == GLOBAL_BATCH // 2  # 2 per micro-batch, dp 1


def test_a_layout_that_cannot_run_is_not_written(tmp_path, capsys):
    # 8 sequences of 4 per micro-batch: 2 micro-batches, fewer than 4 interleaved stages
    args = ["plan", "--model", "tiny", *PLAN[:-8], "--global-batch", "8", "--micro-batch", "4", "--precision", "fp32",
            "--gpus-per-node", "1", "--nodes", "2", "--write-config", str(tmp_path / "x.yaml"),
            "--layout", "FSDP2 x1 + PP 2 (Interleaved1F1B v2, 4 mb)"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "cannot run: pp_microbatches=2 is fewer than the 4 pipeline stages" in err


WORKER = "written_config_worker"
LAUNCH: dict[int, list[str]] = {}
for _name, (_, _gpus, _nodes, *_) in RUNS.items():
    LAUNCH.setdefault(_gpus * _nodes, []).append(_name)


@pytest.mark.parametrize("name", list(RUNS))
def test_written_config_fits_two_steps(launched, name):
    _, gpus, nodes, *_, expected = RUNS[name]
    ranks = launched(WORKER, gpus * nodes)[name]
    assert [r["steps"] for r in ranks] == [2] * gpus * nodes  # `max_steps=2` reached on every rank
    text = "\n".join(ranks[0]["log"] + ranks[0]["layout"])
    if expected:
        assert expected in text, text[-4000:]


# ---- the written YAML runs the planned model, and checkpoints within the run (issue 42, item 6) -----------


def _write(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    path = tmp_path / "planned.yaml"
    main(["plan", *args, "--write-config", str(path)])
    assert f"wrote {path}" in capsys.readouterr().out
    return yaml.safe_load(path.read_text()), path.read_text()


def test_written_config_builds_the_planned_vocabulary(tmp_path, capsys):
    # Formerly `tokenizer: gpt2` and no vocab_size: the model took GPT-2's 50,257 tokens, not the
    # 128,256 the plan's memory and speed assumed for Llama 3.
    from lightning_disttrain import GPTModule, TokenDataModule

    config, text = _write(tmp_path, capsys, "--model", "llama3-8b")
    init = config["model"]["init_args"]
    module = GPTModule(**{k: v for k, v in init.items() if k != "warmup_steps"})
    assert module.config.vocab_size == 128256
    assert shape_of(module.config, 2048).params == shape_of(config_for("llama3-8b"), 2048).params
    tokenizer = config["data"]["init_args"]["tokenizer"]
    assert tokenizer == "gpt2" and "vocab_size 128256 as planned" in text
    data = TokenDataModule(source="embedded", tokenizer=tokenizer)
    assert data.vocab_size <= module.config.vocab_size  # the data module's check before the first batch


def test_written_config_picks_the_tokenizer_of_a_small_vocabulary(tmp_path, capsys):
    config, text = _write(tmp_path, capsys, "--model", "tiny", *PLAN, "--gpus-per-node", "1")
    assert config["data"]["init_args"]["tokenizer"] == "bytes" and config["model"]["init_args"]["vocab_size"] == 257
    assert "as planned" not in text  # the tokenizer is the vocabulary: nothing to explain


@pytest.mark.parametrize("budget", [[], ["--tokens", "1e11"]])
def test_written_checkpoint_cadence_happens_within_max_steps(tmp_path, capsys, budget):
    # Formerly every_n_train_steps: 8242 beside max_steps: 1000 (or 1908): no checkpoint ever.
    config, text = _write(tmp_path, capsys, "--model", "llama3-8b", *budget)
    trainer = config["trainer"]
    (checkpoint,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    every = checkpoint["init_args"]["every_n_train_steps"]
    assert 1 <= every <= trainer["max_steps"], (every, trainer["max_steps"])
    assert f"a checkpoint every {every} steps" in text
    if budget:  # the budget's steps, and the Young/Daly interval inside them
        assert trainer["max_steps"] > every and "(the Young/Daly interval)" in text
