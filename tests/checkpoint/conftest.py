"""Single-process fixtures: real DCP checkpoints of a tiny GPT written by CheckpointWriter."""

from __future__ import annotations

import copy
import shutil
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_helpers import Wrapper, save, train_a_bit  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_single_process_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        yield


@pytest.fixture(scope="session")
def _trained_once():
    module = Wrapper()
    return module, train_a_bit(module)


@pytest.fixture
def trained(_trained_once):
    """A tiny GPT and its AdamW after two steps; a private copy per test (tests train it further)."""
    return copy.deepcopy(_trained_once)  # one deepcopy: the optimizer keeps pointing at the copy's params


@pytest.fixture(scope="session")
def _ckpt_template(tmp_path_factory, _trained_once):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        module, opt = _trained_once
        return save(tmp_path_factory.mktemp("template") / "step=2.ckpt", module, opt, step=2)


@pytest.fixture
def ckpt(tmp_path, _ckpt_template):
    """A real single-process checkpoint of ``trained`` at step 2 (a fresh copy per test)."""
    return Path(shutil.copytree(_ckpt_template, tmp_path / "step=2.ckpt"))
