"""Checkpoints at an fsspec URL (s3://) against a local S3 server (moto, started here on 127.0.0.1).

The same writer, manifest, verification, discovery, fallback and retention as local directories,
through DCP's fsspec storage (FsspecWriter / FsspecReader) and s3fs. Never the network: the
endpoint is the moto server this module starts.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from ckpt_helpers import Wrapper, save

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

from lightning_disttrain.checkpoint import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointVerificationError,
    CheckpointWriter,
    find_latest_checkpoint,
    list_checkpoints,
    load_sharded,
    prune_checkpoints,
    rng,
    storage,
    verify_checkpoint,
)
from lightning_disttrain.checkpoint.dcp_io import Comm, load_meta  # noqa: E402

BUCKET = "ldt-test"


@pytest.fixture(scope="module")
def s3():
    from s3_server import local_s3

    with local_s3(BUCKET):
        yield s3fs.S3FileSystem()


@pytest.fixture
def run_url(s3, request):
    return f"s3://{BUCKET}/{request.node.name}"


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_verify_load_discover_fall_back_and_prune(run_url, trained, s3):
    module, opt = trained
    key = f"{BUCKET}/{run_url.split('/', 3)[3]}"
    writer = CheckpointWriter()
    save(f"{run_url}/step=1.ckpt", module, opt, step=1, writer=writer)
    writer.async_save = True
    save(f"{run_url}/step=2.ckpt", module, opt, step=2, writer=writer)
    writer.close()  # the async one gets its manifest
    save(f"{run_url}/step=3.ckpt", module, opt, step=3)

    manifest = verify_checkpoint(f"{run_url}/step=2.ckpt")
    assert manifest.global_step == 2 and "__0_0.distcp" in manifest.files and "rng/rank_00000.json" in manifest.files
    fresh = Wrapper(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    load_sharded(f"{run_url}/step=2.ckpt", fresh, [[fresh_opt]], Comm())
    assert _same_weights(module, fresh) and fresh_opt.param_groups[0]["lr"] == 1e-3
    assert load_meta(f"{run_url}/step=2.ckpt") == {"global_step": 2, "epoch": 0}
    assert rng.count_saved_ranks(f"{run_url}/step=2.ckpt") == 1

    # Retention: the oldest goes; discovery lists the rest newest first.
    assert prune_checkpoints(run_url, keep_last=2) == [f"{run_url}/step=1.ckpt"]
    assert [c.path for c in list_checkpoints(run_url)] == [f"{run_url}/step=3.ckpt", f"{run_url}/step=2.ckpt"]
    assert find_latest_checkpoint(run_url) == f"{run_url}/step=3.ckpt"

    # Saving over a checkpoint replaces it whole; a prefix holding other objects is refused.
    save(f"{run_url}/step=3.ckpt", module, opt, step=30)
    assert verify_checkpoint(f"{run_url}/step=3.ckpt").global_step == 30
    s3.pipe_file(f"{key}/notes/readme.txt", b"mine")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        save(f"{run_url}/notes", module, opt, step=4)

    # The newest never completed (no manifest): skipped with a warning, the previous one is used.
    s3.rm_file(f"{key}/step=3.ckpt/{MANIFEST_NAME}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_latest_checkpoint(run_url) == f"{run_url}/step=2.ckpt"
    assert any("step=3.ckpt" in str(w.message) and "incomplete" in str(w.message) for w in caught)
    # A corrupted shard (same size, one byte flipped) fails verification, naming the file.
    data = bytearray(s3.cat_file(f"{key}/step=2.ckpt/__0_0.distcp"))
    data[len(data) // 2] ^= 0xFF
    s3.pipe_file(f"{key}/step=2.ckpt/__0_0.distcp", bytes(data))
    with pytest.raises(CheckpointVerificationError, match=r"step=2.ckpt/__0_0.distcp.*corrupted"):
        verify_checkpoint(f"{run_url}/step=2.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert find_latest_checkpoint(run_url) is None


def test_writable_check(run_url):
    assert storage.check_writable(f"{run_url}/ckpts") is None
    problem = storage.check_writable("s3://no-such-bucket-ldt/run")
    assert problem is not None and "no-such-bucket-ldt" in problem and "not writable" in problem


def test_deletes_under_a_url_stay_confined_to_checkpoint_objects(run_url, trained, s3):
    # Issue 30 for object stores: retention and save-over never delete objects that a save did not
    # write, and never a prefix outside the run's checkpoint location.
    from lightning_disttrain.checkpoint.dcp_io import remove_checkpoint_path

    module, opt = trained
    save(f"{run_url}/step=1.ckpt", module, opt, step=1)
    storage.url_write(f"{run_url}/step=1.ckpt/notes.txt", b"mine")
    assert not remove_checkpoint_path(f"{run_url}/step=1.ckpt")
    assert storage.url_files(f"{run_url}/step=1.ckpt")  # nothing went
    assert not remove_checkpoint_path(f"{run_url}/step=1.ckpt", root=f"{run_url}/elsewhere")
    with pytest.raises(Exception, match="not checkpoint files"):
        save(f"{run_url}/step=1.ckpt", module, opt, step=2)
    assert storage.url_files(f"{run_url}/step=1.ckpt") and b"mine" == storage.url_open(
        f"{run_url}/step=1.ckpt/notes.txt").read()
