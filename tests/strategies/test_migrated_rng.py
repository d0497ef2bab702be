"""A project moved to our migration classes draws the same random numbers as under Lightning's
strategies (issue 40): ``migrated_rng_worker.py`` trains a module that initialises itself late
(``on_train_start``, or its first step) under Lightning's ``ModelParallelStrategy`` / ``DDPStrategy``
and under ours at dp1 x tp2, dp2 x tp1 (ModelParallelStrategy, DDP, ZeRO-3), dp2 x tp2 and HSDP, same
seed and data.

Before the fix our setup restarted every rank's global generators (``parallel/rng.py``: per
data-parallel rank) and materialised a meta build without touching them, so ``init_weights`` in
``on_train_start`` drew other numbers: other losses from the first step, and data-parallel
replicas that disagreed."""

from __future__ import annotations

import lightning as L
import pytest

# Imported here, at collection: a test importing the package while conftest's launch thread imports
# it too met a partially initialised module.
from lightning_disttrain.module import GPTModule
from lightning_disttrain.parallel.rng import declares_training_streams

WORKER = "migrated_rng_worker"
LAUNCH = {2: ["lmp_start", "mp_start", "lmp_fwd", "mp_fwd", "lmp1_start", "mp1_start", "lddp_start", "ddp_start",
              "fsdp_start", "ddp_start_unseeded"],
          4: ["lmp_start", "mp_start", "lddp_start", "hsdp_start"]}

# (ours, Lightning's): the same data-parallel ranks, so the same arithmetic.
PAIRS = {2: [("mp_start", "lmp_start"), ("mp_fwd", "lmp_fwd"), ("mp1_start", "lmp1_start"),
             ("ddp_start", "lddp_start"), ("fsdp_start", "lddp_start")],
         4: [("mp_start", "lmp_start"), ("hsdp_start", "lddp_start")]}


def _check_pair(ours: list[dict], theirs: list[dict], what: str) -> None:
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        # Every hook sees the global generator where Lightning's strategy leaves it, on every rank.
        assert o["streams"] == t["streams"], f"{what}, rank {rank}: {o['streams']} != {t['streams']}"
        assert len(o["losses"]) == 4 and o["losses"] == pytest.approx(t["losses"], abs=1e-5), (what, o, t)


@pytest.mark.parametrize("ours,theirs", PAIRS[2])
def test_two_ranks_train_as_under_lightnings_strategy(two, ours, theirs):
    _check_pair(two[ours], two[theirs], f"{ours} vs {theirs}")


@pytest.mark.parametrize("ours,theirs", PAIRS[4])
def test_four_ranks_train_as_under_lightnings_strategy(four, ours, theirs):
    _check_pair(four[ours], four[theirs], f"{ours} vs {theirs}")


def _replica_groups(ranks: list[dict]) -> dict[tuple, set[str]]:
    """(parameter, offsets, sizes) -> the hashes of the ranks that hold that block."""
    groups: dict[tuple, set[str]] = {}
    counts: dict[tuple, int] = {}
    for r in ranks:
        for name, (offsets, sizes, digest) in r["blocks"].items():
            key = (name, tuple(offsets), tuple(sizes))
            groups.setdefault(key, set()).add(digest)
            counts[key] = counts.get(key, 0) + 1
    return {k: v for k, v in groups.items() if counts[k] > 1}


@pytest.mark.parametrize("devices,run", [(2, "mp_start"), (2, "mp_fwd"), (2, "ddp_start"), (2, "ddp_start_unseeded"),
                                         (4, "mp_start"), (4, "hsdp_start")])
def test_replicas_are_bitwise_equal_after_the_modules_late_init(launched, devices, run):
    # TP-replicated norms (mp), whole parameters under DP, the replicas of HSDP (dp2 x tp1 under
    # ModelParallelStrategy shards everything: no replicas to compare); also when the ranks
    # were not seeded alike (ddp_start_unseeded: the strategy gives them rank 0's streams at setup).
    groups = _replica_groups(launched(WORKER, devices)[run])
    assert groups, f"{run}: no parameter block is held by two ranks"
    differ = sorted(k[0] for k, digests in groups.items() if len(digests) > 1)
    assert not differ, f"{run} on {devices} ranks: replicas differ after init_weights(): {differ}"


# ---- the declaration -----------------------------------------------------------------------------


def test_the_package_stream_policy_is_declared_not_imposed():
    assert declares_training_streams(GPTModule) is True  # issue 22's behaviour, declared
    assert declares_training_streams(L.LightningModule()) is False  # anyone else: Lightning's streams

    class Unclear(L.LightningModule):
        independent_training_streams = "yes"

    with pytest.raises(ValueError, match=r"Unclear.independent_training_streams='yes': set it to True"):
        declares_training_streams(Unclear())
