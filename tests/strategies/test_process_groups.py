"""Process groups across fits in one process (issue 38): nothing accumulates, release destroys
everything a layout made, and a layout built again after a release trains as before."""

WORKER, LAUNCH = "groups_worker", {2: ["three_fits"]}  # launched by conftest.py


def test_three_fits_then_release_leave_the_groups_where_they_started(two):
    for r in two["three_fits"]:
        start, end = r["start"], r["end"]
        # Each layout adds only its own groups: FSDP2 over the 2 ranks uses the default group (none),
        # TP 2 the same (none: dp_shard=1 is a size-1 group for FSDP's mesh), HSDP 2x1 its dp_shard.
        assert r["groups_after"]["fsdp2"] == start["groups"], r
        assert r["released"] == r["groups_after"]["hsdp"] - start["groups"] > 0, r
        assert end["groups"] == start["groups"], r
        # Threads too: gloo's threads of a destroyed group end once nothing holds the group. torch's
        # DTensor caches held meshes (and a mesh its groups) until release cleared them, the per-thread
        # sharding cache of the thread backward runs in included (torch_compat.clear_mesh_caches).
        assert end["threads"] == start["threads"], r
        # Two more fits of a layout (rebuilt once, then reused) add only that layout's groups' threads.
        assert r["threads_after_refits"] - end["threads"] <= 3, r


def test_a_layout_rebuilt_after_release_trains_exactly_as_before_and_reuse_makes_no_group(two):
    for r in two["three_fits"]:
        assert r["losses"]["tp2_after_release"] == r["losses"]["tp2"] == r["losses"]["tp2_again"]
        assert r["new_groups_for_the_same_layout"] == 0


def test_release_at_teardown_leaves_groups_and_threads_where_they_started_after_each_fit(two):
    # a sweep over layouts in one process, each fit with release_process_groups_at_teardown=True
    for r in two["three_fits"]:
        start = r["end"]  # after release_all_meshes(): the default group only
        assert [x["layout"] for x in r["at_teardown"]] == ["fsdp2", "tp2", "hsdp"]
        for after in r["at_teardown"]:
            assert (after["groups"], after["threads"]) == (start["groups"], start["threads"]), r["at_teardown"]
