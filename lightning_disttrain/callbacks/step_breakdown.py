"""Where a training step's time goes, from one rank's ``torch.profiler`` events (no Lightning here).

The step is the time between two step-boundary marks on the training thread. Every instant of it
gets exactly one label, by priority, so the parts add up to the step:

1. ``data_wait``: inside a data-wait mark (the training dataloader's ``next()``);
2. ``optimizer``: inside an optimizer mark (gradient clipping and ``optimizer.step``, wall time);
3. ``compute``: an operator is running: on CUDA any kernel that is not a collective; on CPU an
   operator on the training thread (``aten::*`` and other op namespaces, not collectives or waits);
4. ``comm_exposed``: no compute, but a collective is running (a gloo work item on gloo's worker
   threads, an NCCL kernel) or being issued (``c10d::*`` on the training thread);
5. ``idle``: none of these (Python, hooks, logging, launch overhead).

``comm_overlapped`` is reported beside them, not in the sum: collective time during compute (outside
data wait and optimizer). Collectives are counted per kind from the ``c10d::*`` ops the training
thread issued (count, bytes of the larger buffer: the all-gather's output, the reduce-scatter's
input) and timed by the backend's own events: gloo runs each one as a ``gloo:<algorithm>`` event on
a worker thread (a reduce-scatter shows up as ``gloo:all_reduce``: gloo reduces the whole buffer),
paired with the issuing ops in order; NCCL runs ``ncclDevKernel_*`` kernels, matched by kind.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

MARK = "ldt_profiler::"
BOUNDARY, DATA_WAIT, OPTIMIZER = MARK + "step_boundary", MARK + "data_wait", MARK + "optimizer"
PARTS = ("compute", "comm_exposed", "data_wait", "optimizer", "idle")
_COMPUTE_SKIP = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", MARK, "autograd::", "Optimizer.", "FSDP::",
                 "ProfilerStep", "record_param_comms")
_KINDS = (("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
          ("all_gather", "all_gather"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
          ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("broadcast", "broadcast"),
          ("barrier", "barrier"), ("sendrecv", "send_recv"), ("send", "send_recv"), ("recv", "send_recv"),
          ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"))
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
                "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


@dataclass(frozen=True)
class Event:
    """One profiler event, reduced to what the breakdown needs (times in ns)."""

    name: str
    start: int
    end: int
    thread: int
    cuda: bool = False
    user_annotation: bool = False
    shapes: tuple = ()
    dtypes: tuple = ()


def events_from_profiler(prof) -> list[Event]:
    """The events of a stopped ``torch.profiler.profile``."""
    out = []
    for e in prof.profiler.kineto_results.events():
        dev = str(e.device_type())
        out.append(Event(e.name(), e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id(),
                         cuda=dev.endswith("CUDA"), user_annotation=e.is_user_annotation(),
                         shapes=tuple(_shapes(e)), dtypes=tuple(e.dtypes())))
    return out


def _shapes(e) -> list:
    # shapes() leaves tensor-list arguments empty (all_reduce, broadcast); the structured form has them
    structured = getattr(e, "structured_input_shapes", None)
    return list(structured()) if structured is not None else list(e.shapes())


def collective_kind(name: str) -> str:
    """``c10d::_reduce_scatter_base_`` -> ``reduce_scatter``; ``gloo:all_gather`` -> ``all_gather``."""
    low = name.lower().split("::")[-1].split(":")[-1].replace("_base", "").replace("_tensor", "").replace("_into", "")
    low = low.replace("_coalesced", "").strip("_")
    for key, kind in _KINDS:
        if key in low.replace("devkernel_", ""):
            return kind
    return low


def _bytes(e: Event) -> int:
    """The largest tensor (or tensor list) among an op's arguments, in bytes (a tensor list's element
    type is not recorded: counted as 4 bytes)."""
    best = 0
    for shape, dtype in zip(e.shapes, e.dtypes):
        shapes = shape if shape and isinstance(shape[0], (list, tuple)) else [shape]
        n = 0
        for s in shapes:
            count = 1
            for d in s:
                count *= d
            n += count if s else 0
        best = max(best, n * _DTYPE_BYTES.get(dtype, 4) if dtype not in ("", "Scalar", "ScalarList") else 0)
    return best


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(union: list[tuple[int, int]], t: float) -> bool:
    i = bisect.bisect_right(union, (t, float("inf"))) - 1
    return i >= 0 and union[i][0] <= t < union[i][1]


@dataclass
class Collective:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class StepBreakdown:
    """Seconds per part of one step (``PARTS`` sum to ``total``) and the collective time hidden under compute."""

    total: float
    parts: dict[str, float]
    comm_overlapped: float
    measured: float | None = None
    """The step time measured independently (wall clock between the same two hooks), when known."""


@dataclass
class Breakdown:
    steps: list[StepBreakdown]
    collectives: dict[str, Collective] = field(default_factory=dict)
    device: str = "cpu"

    def mean(self, part: str) -> float:
        values = [s.comm_overlapped if part == "comm_overlapped" else s.parts[part] for s in self.steps]
        return sum(values) / len(values)

    @property
    def step_seconds(self) -> float:
        return sum(s.total for s in self.steps) / len(self.steps)

    def to_dict(self) -> dict:
        return {"device": self.device, "step_seconds": self.step_seconds,
                "mean": {p: self.mean(p) for p in (*PARTS, "comm_overlapped")},
                "steps": [{"total": s.total, "measured": s.measured, "comm_overlapped": s.comm_overlapped, **s.parts}
                          for s in self.steps],
                "collectives": {k: vars(c) for k, c in sorted(self.collectives.items())},
                "diagnosis": diagnose(self)}


def breakdown(events: list[Event], measured: list[float] | None = None) -> Breakdown:
    """Per-step breakdown and per-kind collective table of one rank's events (see the module doc)."""
    boundaries = sorted((e for e in events if e.name == BOUNDARY), key=lambda e: e.start)
    if len(boundaries) < 2:
        raise ValueError(f"need at least two step boundaries ({BOUNDARY!r} marks) in the trace, found {len(boundaries)}")
    main = boundaries[0].thread
    cuda = any(e.cuda for e in events)
    data = _union([(e.start, e.end) for e in events if e.name == DATA_WAIT])
    optim = _union([(e.start, e.end) for e in events if e.name == OPTIMIZER])
    issued = sorted((e for e in events if e.thread == main and e.name.startswith("c10d::")), key=lambda e: e.start)
    if cuda:
        backend = [e for e in events if e.cuda and "nccl" in e.name.lower()]
        compute = [(e.start, e.end) for e in events if e.cuda and "nccl" not in e.name.lower()]
    else:
        backend = [e for e in events if e.thread != main and e.name.startswith("gloo:")]
        compute = [(e.start, e.end) for e in events if e.thread == main and "::" in e.name and not e.user_annotation
                   and not e.name.startswith(_COMPUTE_SKIP) and "wait" not in e.name.lower()]
    backend.sort(key=lambda e: e.start)
    compute = _union(compute)
    comm = _union([(e.start, e.end) for e in backend] + [(e.start, e.end) for e in issued])
    exec_only = _union([(e.start, e.end) for e in backend])
    steps = []
    for i, (a, b) in enumerate(zip(boundaries, boundaries[1:])):
        lo, hi = a.end, b.end  # a mark's end: after the hook's previous work, before what follows it
        cuts = sorted({lo, hi, *(t for u in (data, optim, compute, comm) for iv in u for t in iv if lo < t < hi)})
        parts = dict.fromkeys(PARTS, 0.0)
        overlapped = 0.0
        for x, y in itertools.pairwise(cuts):
            mid, dt = (x + y) / 2, (y - x) / 1e9
            if _covered(data, mid):
                parts["data_wait"] += dt
            elif _covered(optim, mid):
                parts["optimizer"] += dt
            elif _covered(compute, mid):
                parts["compute"] += dt
                overlapped += dt if _covered(exec_only, mid) else 0.0
            elif _covered(comm, mid):
                parts["comm_exposed"] += dt
            else:
                parts["idle"] += dt
        steps.append(StepBreakdown((hi - lo) / 1e9, parts, overlapped,
                                   measured[i] if measured and i < len(measured) else None))
    window = (boundaries[0].end, boundaries[-1].end)
    return Breakdown(steps, _collectives(issued, backend, window), "cuda" if cuda else "cpu")


def _collectives(issued: list[Event], backend: list[Event], window: tuple[int, int]) -> dict[str, Collective]:
    inside = [e for e in issued if window[0] <= e.start < window[1]]
    table: dict[str, Collective] = defaultdict(Collective)
    for e in inside:
        c = table[collective_kind(e.name)]
        c.count += 1
        c.bytes += _bytes(e)
    # gloo runs every issued collective as one work item, in order: pair them. Otherwise (NCCL
    # kernels, or events cut off at the window's edges) the backend event's own name gives the kind.
    paired = [e for e in backend if e.start >= inside[0].start] if inside else []
    if inside and len(paired) >= len(inside) and all(not e.cuda for e in paired):
        for op, run in zip(inside, paired):
            table[collective_kind(op.name)].seconds += (run.end - run.start) / 1e9
    else:
        for run in backend:
            if window[0] <= run.start < window[1]:
                table[collective_kind(run.name)].seconds += (run.end - run.start) / 1e9
    return dict(table)


def diagnose(b: Breakdown) -> str:
    """One line: compute-, communication- or dataloader-bound, with the shares behind it."""
    total = b.step_seconds
    share = {p: b.mean(p) / total if total else 0.0 for p in PARTS}
    work = share["compute"] + share["optimizer"]
    candidates = {"compute-bound": work, "communication-bound": share["comm_exposed"],
                  "dataloader-bound": share["data_wait"]}
    verdict = max(candidates, key=candidates.get)
    advice = {"compute-bound": "the operators themselves are the limit; next: compile, fp8, a larger micro batch",
              "communication-bound": "collectives wait in the open; overlap them (prefetch), shard over fewer ranks "
                                     "(HSDP), or raise the micro batch",
              "dataloader-bound": "the step waits for data; raise DataLoader num_workers, prefetch_factor, "
                                  "pin_memory, or pre-tokenize"}[verdict]
    if share["idle"] >= 0.25:
        advice += f"; idle {share['idle']:.0%} is host time between ops (Python, hooks, launches): compile, CUDA graphs"
    shares = ", ".join(f"{p.replace('_', ' ')} {share[p]:.0%}" for p in PARTS)
    return f"{verdict}: {shares} of a {total * 1e3:.1f} ms step; {advice}"
