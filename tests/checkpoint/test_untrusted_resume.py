"""Resume through the strategy from touched checkpoints, on 2 gloo ranks (issue 30): a malformed
manifest is skipped by every rank (none is left waiting in a collective) and ``ckpt_path="last"``
falls back to the checkpoint before it; a planted DCP ``.metadata`` is refused by every rank and
loads with ``strategy.trust_checkpoint = True``. Worker: ``tests/strategies/untrusted_ckpt_worker.py``."""

WORKER, LAUNCH = "untrusted_ckpt_worker", {2: ["malformed", "planted"]}  # launched by tests/conftest.py


def test_a_malformed_manifest_is_skipped_on_every_rank(launched):
    from untrusted_helpers import MALFORMED

    ranks = launched(WORKER, 2)["malformed"]
    for kind in MALFORMED:  # step=2.ckpt skipped, step=1.ckpt resumed, on both ranks
        assert [r["resumed_at"][kind] for r in ranks] == [1, 1], kind


def test_planted_metadata_is_refused_on_every_rank_and_loads_when_trusted(launched):
    ranks = launched(WORKER, 2)["planted"]
    for r in ranks:
        assert r["refused"] and "refusing to load" in r["refused"] and "--trust-checkpoint" in r["refused"]
        assert r["marker_after_refusal"] is False
        assert r["marker_after_trust"] is True and r["resumed_at"] == 1
