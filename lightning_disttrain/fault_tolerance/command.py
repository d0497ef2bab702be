"""``lightning-disttrain ft-lighthouse`` and ``ft-local``: fault tolerance from the command line.

    lightning-disttrain ft-lighthouse --port 29510            # where replica groups meet (keep it running)
    lightning-disttrain ft-local --config configs/fault-tolerant.yaml --groups 2 [--demo-failure 20]

``ft-local`` tries a fault-tolerant run on one machine: it starts a lighthouse in its own process
and ``lightning-disttrain fit --config ...`` once per replica group (``$LDT_FT_REPLICA_ID`` and
``$TORCHFT_LIGHTHOUSE`` set for each), each group's output in ``<log-dir>/group<G>.log``. With
``--demo-failure S`` it SIGKILLs the last group S seconds after the groups start and launches it
again: the others train on, and the relaunched group heals from them. On a cluster, start
``ft-lighthouse`` once and each group as its own job with those two variables set.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LIGHTHOUSE_DOC = "start a torchft lighthouse: where the replica groups of fault-tolerant runs meet"
LOCAL_DOC = "try a fault-tolerant run on this machine: a lighthouse and one `fit` per replica group"


def _lighthouse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-replicas", type=int, default=1,
                   help="fewest replica groups that form a quorum (default 1: a lone survivor trains on)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                   help="a silent group counts as dead after this long: the survivors' wait after a failure")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long a forming quorum waits for groups that heartbeat but have not asked yet")


def _start(args: argparse.Namespace, port: int):
    from lightning_disttrain.fault_tolerance.lighthouse import start_lighthouse
    from lightning_disttrain.fault_tolerance.replicas import require_torchft

    try:
        require_torchft()
    except ImportError as err:
        raise ValueError(str(err)) from None  # one line from the CLI: what to install

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum at INFO otherwise
    return start_lighthouse(port, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                            heartbeat_timeout_ms=args.heartbeat_timeout_ms)


def lighthouse_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lightning-disttrain ft-lighthouse", description=LIGHTHOUSE_DOC)
    p.add_argument("--port", type=int, default=29510, help="TCP port on every interface (0: any free one)")
    _lighthouse_args(p)
    args = p.parse_args(argv)
    lighthouse = _start(args, args.port)
    port = lighthouse.address().rpartition(":")[2]
    print(f"lighthouse listening on port {port}: start each replica group with TORCHFT_LIGHTHOUSE="
          f"http://<this host>:{port} (Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.shutdown()


def local_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lightning-disttrain ft-local", description=LOCAL_DOC)
    p.add_argument("--config", required=True, help="the LightningCLI YAML every group runs (fit)")
    p.add_argument("--groups", type=int, default=2, help="replica groups to start (its fault_tolerance."
                   "num_replica_groups must be at least this)")
    p.add_argument("--log-dir", default="runs/ft-local", help="where group<G>.log go")
    p.add_argument("--demo-failure", type=float, metavar="SECONDS",
                   help="SIGKILL the last group this long after the start, then launch it again")
    _lighthouse_args(p)
    args, fit_args = p.parse_known_args(argv)
    if args.groups < 1:
        raise ValueError(f"--groups={args.groups}: start at least one replica group")
    config = Path(args.config)
    if not config.is_file():
        raise ValueError(f"--config {args.config}: no such file")
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    lighthouse = _start(args, 0)
    address = f"http://localhost:{lighthouse.address().rpartition(':')[2]}"
    print(f"lighthouse at {address}; {args.groups} replica groups of {config}, logs in {logs}/", flush=True)
    procs: dict[int, subprocess.Popen] = {}
    launches = {g: 0 for g in range(args.groups)}

    def launch(g: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
        env.update(LDT_FT_REPLICA_ID=str(g), TORCHFT_LIGHTHOUSE=address, RUST_LOG=env.get("RUST_LOG", "warn"))
        cmd = [sys.executable, "-m", "lightning_disttrain.cli", "fit", "--config", str(config),
               *_logger_version(config, g), *fit_args]
        log = open(logs / f"group{g}.log", "a")
        log.write(f"--- launch {launches[g]}: {' '.join(cmd)}\n")
        log.flush()
        procs[g] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        launches[g] += 1
        print(f"  group {g}: pid {procs[g].pid}, log {logs / f'group{g}.log'}", flush=True)

    try:
        for g in range(args.groups):
            launch(g)
        if args.demo_failure is not None:
            victim = args.groups - 1
            time.sleep(args.demo_failure)
            if procs[victim].poll() is None:
                os.killpg(procs[victim].pid, signal.SIGKILL)
                procs[victim].wait()
                print(f"demo: SIGKILLed group {victim}; the others train on. Launching it again: it heals from them",
                      flush=True)
                launch(victim)
        codes = {g: proc.wait() for g, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.shutdown()
    for g, code in codes.items():
        print(f"group {g}: exit code {code}", flush=True)
    if any(codes.values()):
        raise SystemExit(1)


def _logger_version(config: Path, group: int) -> list[str]:
    """Each group logs to its own version directory when the config's logger is a file logger
    (CSV / TensorBoard) without a version: otherwise the groups would pick the same one."""
    import yaml

    logger = (yaml.safe_load(config.read_text()) or {}).get("trainer", {}).get("logger")
    if not isinstance(logger, dict) or not str(logger.get("class_path", "")).endswith(("CSVLogger",
                                                                                           "TensorBoardLogger")):
        return []
    if (logger.get("init_args") or {}).get("version") is not None:
        return []
    return ["--trainer.logger.init_args.version", f"replica_{group}"]
