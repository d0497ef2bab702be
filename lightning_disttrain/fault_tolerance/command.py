"""``lightning-disttrain ft-lighthouse`` and ``ft-local``: fault tolerance from the command line.

    lightning-disttrain ft-lighthouse --port 29510            # where replica groups meet (keep it running)
    lightning-disttrain ft-local --config configs/fault-tolerant.yaml --groups 2 [--demo-failure 30] [FIT OPTIONS]

``ft-local`` tries a fault-tolerant run on one machine: it starts ``ft-lighthouse`` in its own process
(its output, torchft's several lines per quorum, in ``<log-dir>/lighthouse.log``) and
``lightning-disttrain fit --config ...`` once per replica group (``$LDT_FT_REPLICA_ID`` and
``$TORCHFT_LIGHTHOUSE`` set for each; every argument ``ft-local`` does not know itself, e.g.
``--trainer.max_steps 20``, goes to each group's ``fit``). Each group's output goes to
``<log-dir>/group<G>.log`` (a relaunch appends); the terminal shows a line per group every
``log_every_n_steps`` (``GroupProgress``: step, loss, live groups, committed, s/step) and the
fault-tolerance events (quorum changes, heals, the demo's kill and relaunch). On CPU each group gets
its share of the cores (``OMP_NUM_THREADS``): two groups of two threads on two cores ran 5-20x
slower per step than one, from the oversubscription alone (two plain fits side by side too).
With ``--demo-failure S`` it SIGKILLs the last group S seconds after the groups start and launches
it again: the others train on, and the relaunched group heals from them (its CSV/TensorBoard version
``replica_<G>-relaunch<N>`` beside the first one's). On a cluster, start ``ft-lighthouse`` once and
each group as its own job with those two variables set.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

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

    # torchft's lighthouse logs every quorum at INFO (several lines a step) unless RUST_LOG says
    # otherwise when torchft is first imported: before require_torchft.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        require_torchft()
    except ImportError as err:
        raise ValueError(str(err)) from None  # one line from the CLI: what to install
    return start_lighthouse(port, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                            heartbeat_timeout_ms=args.heartbeat_timeout_ms)


def lighthouse_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="lightning-disttrain ft-lighthouse", description=LIGHTHOUSE_DOC, allow_abbrev=False)
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


PROGRESS_TAG = "[ft-local]"
"""The start of each line a group prints for ``ft-local``'s terminal (``GroupProgress``)."""
_EVENTS = (PROGRESS_TAG, "fault tolerance:", "error:")
"""A group's output lines that ``ft-local`` shows on the terminal; every line goes to its log."""


class GroupProgress(Callback):
    """One line every ``every_n_steps`` (default: the Trainer's ``log_every_n_steps``) on the group's
    global rank 0: step, loss, live groups, committed. ``ft-local`` adds it to every group and shows
    these lines on its terminal."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._last = self._since = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps or 1
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last or (step % every and step != trainer.max_steps):
            return
        now = time.perf_counter()
        pace = f"{(now - self._since[1]) / (step - self._since[0]):.2f} s/step" if self._since else None
        self._last, self._since = step, (step, now)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # this group's loss, this step
        ft = getattr(trainer.strategy, "ft_metrics", None) or {}
        words = [f"step {step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        if loss is not None:
            words.append(f"loss {float(loss):.3f}")
        if "ft/live_replicas" in ft:
            words.append(f"{int(ft['ft/live_replicas'])} group(s) live")
            words.append("committed" if ft.get("ft/committed") else "NOT committed")
        if pace:
            words.append(pace)
        print(f"{PROGRESS_TAG} " + ", ".join(words), flush=True)


def group_command(config: Path, group: int, launch: int, fit_args: list[str]) -> list[str]:
    """The ``fit`` command line of replica group ``group`` (its ``launch``-th start): the config, the
    group's own logger version (a relaunch writes beside the earlier launch's, not over it), the
    progress callback, then ``fit_args``, every argument of ``ft-local`` it does not know itself (so
    ``--trainer.max_steps 20`` reaches every group, and wins over the config)."""
    return [sys.executable, "-m", "lightning_disttrain.cli", "fit", "--config", str(config),
            *_logger_version(config, group, launch),
            f"--trainer.callbacks+={__name__}.GroupProgress", *fit_args]


def _threads_per_group(groups: int, config: Path, fit_args: list[str]) -> int | None:
    """CPU runs: each group's share of the cores. Lightning gives a one-process launch every core,
    so N groups on one machine would run N x the cores' threads and slow each other down."""
    import yaml

    trainer = dict((yaml.safe_load(config.read_text()) or {}).get("trainer", {}) or {})
    for i, arg in enumerate(fit_args):  # --trainer.devices / --trainer.accelerator on the command line win
        for name in ("devices", "accelerator"):
            if arg == f"--trainer.{name}" and i + 1 < len(fit_args):
                trainer[name] = fit_args[i + 1]
            elif arg.startswith(f"--trainer.{name}="):
                trainer[name] = arg.partition("=")[2]
    devices = trainer.get("devices", 1)
    if str(trainer.get("accelerator", "cpu")) != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    try:
        per_group = max(1, int(devices))
    except (TypeError, ValueError):
        per_group = 1
    return max(1, (os.cpu_count() or 1) // (groups * per_group))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="lightning-disttrain ft-local", description=LOCAL_DOC, allow_abbrev=False,
        usage="%(prog)s --config CONFIG [--groups N] [--demo-failure SECONDS] [...] [FIT OPTIONS]",
        epilog="Every other argument goes to each group's `fit` (e.g. --trainer.max_steps 20). The terminal "
               "shows each group's progress and the fault-tolerance events; each group's full output is in "
               "<log-dir>/group<G>.log (a relaunch appends), the lighthouse's in <log-dir>/lighthouse.log.")
    p.add_argument("--config", required=True, help="the LightningCLI YAML every group runs (fit)")
    p.add_argument("--groups", type=int, default=2, help="replica groups to start (its fault_tolerance."
                   "num_replica_groups must be at least this)")
    p.add_argument("--log-dir", default="runs/ft-local", help="where group<G>.log and lighthouse.log go")
    p.add_argument("--demo-failure", type=float, metavar="SECONDS",
                   help="SIGKILL the last group this long after the start, then launch it again")
    _lighthouse_args(p)
    args, fit_args = p.parse_known_args(argv)
    if args.groups < 1:
        raise ValueError(f"--groups={args.groups}: start at least one replica group")
    config = Path(args.config)
    if not config.is_file():
        raise ValueError(f"--config {args.config}: no such file")
    from lightning_disttrain.fault_tolerance.replicas import require_torchft

    try:
        require_torchft()
    except ImportError as err:
        raise ValueError(str(err)) from None  # one line from the CLI: what to install
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # The lighthouse in its own process, its output (torchft logs every quorum at INFO, several lines
    # a step) in lighthouse.log rather than on this terminal.
    port = _free_port()
    lighthouse_log = open(logs / "lighthouse.log", "a")
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "lightning_disttrain.cli", "ft-lighthouse", "--port", str(port),
         "--min-replicas", str(args.min_replicas), "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms),
         "--join-timeout-ms", str(args.join_timeout_ms)],
        stdout=lighthouse_log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})  # every quorum, in the file
    address = f"http://localhost:{port}"
    threads = _threads_per_group(args.groups, config, fit_args)
    print(f"lighthouse at {address}; {args.groups} replica groups of {config}"
          + (f" ({threads} CPU thread(s) each)" if threads else "")
          + (f", passing {' '.join(fit_args)}" if fit_args else "")
          + f"; logs in {logs}/", flush=True)
    procs: dict[int, subprocess.Popen] = {}
    readers: dict[int, list] = {g: [] for g in range(args.groups)}
    launches = {g: 0 for g in range(args.groups)}
    start = time.monotonic()

    def say(text: str) -> None:
        print(f"{time.monotonic() - start:6.1f}s  {text}", flush=True)

    def relay(g: int, proc: subprocess.Popen, log) -> None:
        # every line to the group's log, the progress and fault-tolerance lines to the terminal too
        for raw in proc.stdout:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").rstrip("\n").split("\r")[-1].strip()
            if line.startswith(_EVENTS):
                say(f"group {g} | {line.removeprefix(PROGRESS_TAG).strip()}")
        log.close()

    def launch(g: int) -> None:
        import threading

        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
        env.update(LDT_FT_REPLICA_ID=str(g), TORCHFT_LIGHTHOUSE=address, RUST_LOG=env.get("RUST_LOG", "warn"),
                   PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = group_command(config, g, launches[g], fit_args)
        for earlier in readers[g]:  # the killed launch's last lines are in its log before the next one's
            earlier.join(timeout=10)
        log = open(logs / f"group{g}.log", "ab")  # a relaunch appends
        log.write(f"--- launch {launches[g]}: {' '.join(cmd)}\n".encode())
        log.flush()
        procs[g] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        reader = threading.Thread(target=relay, args=(g, procs[g], log), daemon=True)
        reader.start()
        readers[g].append(reader)
        say(f"group {g}: {'started' if not launches[g] else 'relaunched'} (pid {procs[g].pid}, "
            f"log {logs / f'group{g}.log'})")
        launches[g] += 1

    codes: dict[int, int] = {}
    try:
        for g in range(args.groups):
            launch(g)
        victim = args.groups - 1 if args.demo_failure is not None else None
        while any(proc.poll() is None for proc in procs.values()):
            if lighthouse.poll() is not None:
                tail = (logs / "lighthouse.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise ValueError(f"the lighthouse exited (code {lighthouse.returncode}): " + " / ".join(tail))
            if victim is not None and time.monotonic() >= start + args.demo_failure:
                if procs[victim].poll() is None:
                    os.killpg(procs[victim].pid, signal.SIGKILL)
                    procs[victim].wait()
                    say(f"demo: SIGKILLed group {victim}; the others train on. Launching it again: it heals from them")
                    launch(victim)
                victim = None
            time.sleep(0.2)
        codes = {g: proc.wait() for g, proc in procs.items()}
        for reader in (r for group_readers in readers.values() for r in group_readers):
            reader.join(timeout=10)
    except KeyboardInterrupt:
        say("interrupted: stopping the groups and the lighthouse")
        raise SystemExit(130) from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if lighthouse.poll() is None:
            lighthouse.terminate()
            try:
                lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse_log.close()
    for g, code in codes.items():
        say(f"group {g}: exit code {code}" + (f"; the end of {logs / f'group{g}.log'}:" if code else ""))
        if code:
            tail = [ln for ln in (logs / f"group{g}.log").read_text(errors="replace").splitlines() if ln.strip()]
            print("\n".join("    " + ln.split("\r")[-1] for ln in tail[-8:]), flush=True)
    if any(codes.values()):
        raise SystemExit(1)


def _logger_version(config: Path, group: int, launch: int = 0) -> list[str]:
    """Each group logs to its own version directory when the config's logger is a file logger
    (CSV / TensorBoard) without a version: otherwise the groups would pick the same one. A relaunch
    gets a directory of its own beside it (``replica_<G>-relaunch<N>``): Lightning's CSV logger
    deletes the metrics of a directory it opens again."""
    import yaml

    logger = (yaml.safe_load(config.read_text()) or {}).get("trainer", {}).get("logger")
    if not isinstance(logger, dict) or not str(logger.get("class_path", "")).endswith(("CSVLogger",
                                                                                           "TensorBoardLogger")):
        return []
    if (logger.get("init_args") or {}).get("version") is not None:
        return []
    return ["--trainer.logger.init_args.version", f"replica_{group}" + (f"-relaunch{launch}" if launch else "")]
