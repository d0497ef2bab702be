"""Two "nodes" on one machine: HSDP that shards within a node and replicates across nodes.

Under torchrun (two commands, as on two machines; here both on 127.0.0.1):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/multinode_hsdp.py --nodes 2 --devices 2 --out runs/multinode      # terminal 1
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/multinode_hsdp.py --nodes 2 --devices 2 --out runs/multinode      # terminal 2

Under SLURM (``srun`` starts every task with SLURM_* variables, which Lightning's
``SLURMEnvironment`` reads): ``srun --nodes 2 --ntasks-per-node 2 python examples/multinode_hsdp.py
--nodes 2 --devices 2``. ``--fake-slurm`` starts the 4 tasks here with the variables srun would
set, to try that path without a cluster.

``FSDP2Strategy(hsdp="auto")`` makes the mesh (replicate = nodes, shard = devices per node):
parameters are sharded over the 2 ranks of a node, and each node holds a full replica, so the
all-gathers and reduce-scatters stay inside a node and only the gradient all-reduce crosses
nodes. ``PreemptionCheckpoint`` is on: SIGTERM to any process saves and exits every rank on both
"nodes"; relaunching the same commands resumes (``--resume``). Each rank prints its node, its
place in the mesh and its shard of the first block's weight.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(args) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_disttrain import GPTModule, TokenDataModule
    from lightning_disttrain.callbacks import PreemptionCheckpoint
    from lightning_disttrain.strategies import FSDP2Strategy

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(1337)
    ckpt_dir = os.path.join(args.out, "checkpoints")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                        strategy=FSDP2Strategy(hsdp="auto"), max_steps=args.max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=args.out,
                        callbacks=[PreemptionCheckpoint(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5,
                                                                           save_last="link")])
    module = GPTModule(config="tiny", lr=3e-3, warmup_steps=2)
    data = TokenDataModule(source="embedded", tokenizer="bytes", seq_len=64, batch_size=4, val_batches=0)
    trainer.fit(module, datamodule=data, ckpt_path="last" if args.resume else None)
    mesh = trainer.strategy.device_mesh
    name, weight = next(module.model.named_parameters())
    print(f"rank {trainer.global_rank} node {trainer.node_rank} env {type(trainer.strategy.cluster_environment).__name__}: "
          f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} coordinate {mesh.get_coordinate()}, "
          f"{name}: local shard {tuple(weight.to_local().shape)} of {tuple(weight.shape)}, "
          f"step {trainer.global_step}, loss {float(trainer.callback_metrics.get('train/loss', float('nan'))):.4f}",
          flush=True)


def fake_slurm(args) -> int:
    """Start nodes x devices tasks with the variables ``srun`` sets; wait for all."""
    world = args.nodes * args.devices
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
        env.update(SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(args.devices), SLURM_NNODES=str(args.nodes),
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % args.devices), SLURM_NODEID=str(rank // args.devices),
                   SLURM_JOB_ID="4242", SLURM_JOB_NAME="multinode_hsdp", SLURM_JOB_NODELIST="localhost",
                   PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--nodes", str(args.nodes), "--devices", str(args.devices),
               "--max-steps", str(args.max_steps), "--out", args.out, *(["--resume"] if args.resume else [])]
        procs.append(subprocess.Popen(cmd, env=env))
    return max(abs(p.wait()) for p in procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--out", default="runs/multinode")
    p.add_argument("--resume", action="store_true", help='ckpt_path="last"')
    p.add_argument("--fake-slurm", action="store_true", help="start the tasks here with srun's variables")
    args = p.parse_args()
    if args.fake_slurm:
        raise SystemExit(fake_slurm(args))
    train(args)


if __name__ == "__main__":
    main()
