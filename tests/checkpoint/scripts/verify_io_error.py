"""Two gloo ranks verify one checkpoint; reading a file fails with an OSError on rank 1 only.

    (RANK/WORLD_SIZE/MASTER_* from tests/dist_utils.run_torch_script) python verify_io_error.py CKPT OUT

Each rank writes OUT/verify.rankR.json with the error it raised. Before the fix rank 1 raised the
OSError on its own while rank 0 waited for it in all_gather (until the collective timeout).
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dist_utils import exit_without_teardown, write_rank_json  # noqa: E402
from lightning_disttrain.checkpoint import manifest  # noqa: E402
from lightning_disttrain.checkpoint.dcp_io import Comm, verify_distributed  # noqa: E402

ckpt, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
if rank == 1:
    def failing_read(path):  # an I/O error on this rank's disk, e.g. a flaky network mount
        raise OSError(5, "Input/output error", str(path))

    manifest.sha256_file = failing_read
try:
    verify_distributed(ckpt, Comm())
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
write_rank_json(out, "verify", rank, {"error": error})
dist.destroy_process_group()
exit_without_teardown()
