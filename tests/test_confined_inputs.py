"""Files named inside downloaded inputs stay inside them, and readers stop where asked (issue 30,
findings 6 and 7): a sharded Hugging Face index or a prepared data directory's meta.json that
names a file outside its directory is refused before anything is read; ``eval --limit N`` reads
only the first N items of a JSONL file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from lightning_disttrain.data.sources import find_shards
from lightning_disttrain.evals.tasks import load_task
from lightning_disttrain.models.hf import HFWeights


def test_a_sharded_index_may_not_map_weights_outside_its_directory(tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file({"transformer.wte.weight": np.zeros((2, 2), dtype=np.float32)}, str(outside))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "../outside.safetensors"}}))
    with pytest.raises(ValueError, match="not a file name in that directory"):
        HFWeights(model, "transformer.")


@pytest.mark.parametrize("name", ["../outside_train_000000.bin", "/etc/hostname", "sub/x.bin", ".."])
def test_meta_json_may_not_list_shards_outside_its_directory(tmp_path, name):
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"train": {"shards": [name]}, "val": {"shards": []}}))
    with pytest.raises(ValueError, match="lists shards outside its directory"):
        find_shards(str(data))


def test_limit_stops_reading_the_jsonl(tmp_path):
    # Three good items, then a line that is not JSON: reading must stop before it.
    good = {"query": "q", "choices": ["a", "b"], "gold": 0}
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join([json.dumps(good)] * 3 + ["not json at all"]) + "\n")
    task = load_task(f"mine={path}", limit=3)
    assert len(task.items) == 3 and task.total is None
    with pytest.raises(ValueError, match="line 4 is not JSON"):
        load_task(f"mine={path}")  # without a limit the whole file is read
