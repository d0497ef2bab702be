"""Large models never materialise whole on one rank by default (issue 38): under the strategy's
default ``empty_init`` (the meta device when more than one rank shares the model), the peak tensor
memory per rank while setting up (``configure_model`` through ``strategy.setup``) is at most half
the model's fp32 bytes plus its largest parameter (GPT: each full parameter is drawn once, and the
rank keeps its shard) or its largest initialiser's parameters (a module initialised by
``reset_parameters()``), plus 10%. Before, every rank built the whole model eagerly and then
sharded it: its peak was the whole model and its shard. Counted by ``setup_memory_worker.
LiveTensorBytes`` (the figure for gpt2-1558m: ``benchmarks/bench_setup_memory.py``).

A module that is not layout independent gets, gathered, the weights ``materialize_`` gives it on
one process, and replicas hold rank 0's bitwise even where an initialiser depends on the rank.
"""

from __future__ import annotations

import pytest
import torch

import setup_memory_worker as worker
from lightning_disttrain.models.param_init import init_settings
from lightning_disttrain.parallel.materialize import materialize_

WORKER, LAUNCH = "setup_memory_worker", {2: ["gpt", "generic", "generic_replicas"]}  # launched by conftest.py

pytestmark = pytest.mark.slow


def _bound(r: dict, largest: str) -> float:
    return 1.1 * (r["model_bytes"] / 2 + r[largest])


def test_gpt_setup_peak_is_half_the_model_plus_one_parameter(two):
    for r in two["gpt"]:
        assert r["peak"] <= _bound(r, "largest_param_bytes"), (
            f"peak {r['peak'] / 2**20:.2f} MiB per rank, bound {_bound(r, 'largest_param_bytes') / 2**20:.2f} MiB "
            f"(model {r['model_bytes'] / 2**20:.2f} MiB)")


def test_generic_setup_peak_is_half_the_model_plus_one_initialiser(two):
    for r in two["generic"]:
        assert r["largest_unit_bytes"] < r["model_bytes"] / 4  # the bound means something
        assert r["peak"] <= _bound(r, "largest_unit_bytes"), (
            f"peak {r['peak'] / 2**20:.2f} MiB per rank, bound {_bound(r, 'largest_unit_bytes') / 2**20:.2f} MiB "
            f"(model {r['model_bytes'] / 2**20:.2f} MiB)")


def _one_process(seed: int) -> dict[str, torch.Tensor]:
    # The LightningModule, as the strategy materialises it: its initialisers are seeded by their
    # names below it ("net.embed").
    module = worker.Generic()
    with torch.device("meta"):
        module.configure_model()
    with init_settings(seed=seed):
        materialize_(module, "cpu")
    net = module.net
    return {n: t.detach().clone() for n, t in list(net.named_parameters()) + list(net.named_buffers())}


@pytest.mark.parametrize("run", ["generic", "generic_replicas"])
def test_generic_weights_are_one_process_materialisation_and_rank_0s(two, run):
    ranks = two[run]
    expected = _one_process(ranks[0]["seed"])
    saved = [torch.load(r["file"]) for r in ranks]
    for got in saved:
        assert set(got["gathered"]) == set(expected)
        for name, t in got["gathered"].items():
            assert torch.equal(t, expected[name]), f"{run}: {name} differs from materialize_ on one process"
    if run == "generic_replicas":  # each rank holds the whole model: rank 1's is rank 0's
        for name, t in saved[1]["local"].items():
            assert torch.equal(t, saved[0]["local"][name]), f"replicas differ at {name}"
    assert torch.equal(saved[0]["gathered"]["gain.scale"], torch.ones(worker.DIM))  # rank 0's rank-dependent init
