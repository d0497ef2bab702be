"""Memory meters for ``bench_fsdp.py``: the figures an allocator (or the kernel) reports, not sums
of the tensors we know about.

All three share one interface, so a benchmark marks the same points whatever it measures with:
``start()`` (the baseline), ``mark(name)`` (bytes held now), ``begin_window(name)`` /
``end_window(name)`` (the peak in between), ``stop()``, then ``levels`` and ``peaks`` (bytes
relative to the baseline).

``ProcessMeter`` (``--meter process``, CPU; the primary CPU figure)
    The whole process, every thread. ``memcount.so`` (``memcount.c``, loaded with ``LD_PRELOAD``)
    counts the bytes glibc's malloc has handed out and not had back, with a resettable peak:
    ``levels`` at marks and the exact ``peaks`` over a window, whoever allocates (c10's CPU
    allocator, gloo's worker threads, Python, Lightning). Two cross-checks from the same moments:
    glibc's own ``mallinfo2()`` (bytes in use, all arenas plus mmapped chunks; no peak) and the
    kernel's peak resident set size (``VmHWM``, reset with ``echo 5 > /proc/self/clear_refs``).
    RSS counts memory glibc keeps after ``free``; the benchmark starts these processes with
    ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so that freed blocks go back to the
    kernel and the RSS peak follows what is in use (to page granularity).

``AllocatorTimeline`` (``--meter alloc``, CPU; tensors only)
    ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of c10's CPU
    allocator, the one every CPU tensor storage comes from, with its signed size and time. Replayed
    in time order (a running sum, started at the baseline) they give the bytes held at any mark
    and the peak between two marks, temporaries inside one op included. Marks are
    ``record_function`` events on the same clock. Limit: only threads the profiler is enabled on
    report (the caller's and autograd's; ``profile_all_threads`` adds no memory events). A tensor
    allocated on the main thread whose last reference goes away on one of gloo's worker threads
    (the input and output of an async collective, held by its ``Work``) is never reported freed,
    so with more than one rank the running sum drifts upward by such buffers, by chance per rank
    and step. ``bench_fsdp.py`` prints that drift next to these figures.

``CudaMeter`` (``--meter cuda``)
    ``torch.cuda.memory_allocated`` at marks and ``max_memory_allocated`` over a window (after
    ``reset_peak_memory_stats``), the caching allocator's own counters. Written for a GPU run;
    not exercised on the CPU machine these benchmarks ran on.

``self_check(meter)`` allocates and touches a 100 MiB tensor inside a window: a meter that works
reports +100 MiB while it lives, a peak of 100 MiB and ~0 after it is freed.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools

import torch

MIB = 2**20
_MARK = "memory_meter::"


class AllocatorTimeline:
    name = "c10 CPU allocator (torch.profiler memory events)"

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._prof = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.mark("start")

    def mark(self, name: str) -> None:
        with torch.profiler.record_function(_MARK + name):
            pass

    def begin_window(self, name: str) -> None:
        self.mark(name + ":begin")

    def end_window(self, name: str) -> None:
        self.mark(name + ":end")

    def stop(self) -> None:
        self._prof.__exit__(None, None, None)
        events = self._prof.profiler.kineto_results.events()
        cpu = torch.autograd.DeviceType.CPU
        mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu)
        marks = {e.name()[len(_MARK):]: e.start_ns() for e in events if e.name().startswith(_MARK)}
        self._prof = None
        times = [t for t, _ in mem]
        running = list(itertools.accumulate(n for _, n in mem))
        t0 = marks["start"]
        base = running[bisect.bisect_right(times, t0) - 1] if bisect.bisect_right(times, t0) else 0

        def level(t: int) -> int:
            i = bisect.bisect_right(times, t)
            return (running[i - 1] if i else 0) - base

        for name, t in marks.items():
            if name.endswith(":begin"):
                end = marks.get(name[: -len(":begin")] + ":end")
                if end is not None:
                    lo, hi = bisect.bisect_right(times, t), bisect.bisect_right(times, end)
                    inside = running[lo:hi]
                    self.peaks[name[: -len(":begin")]] = max([level(t)] + [r - base for r in inside])
            self.levels[name] = level(t)


class ProcessMeter:
    name = "malloc bytes in use, every thread (memcount.so)"

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}    # memcount: malloc bytes in use
        self.peaks: dict[str, int] = {}     # memcount: the most in use over a window
        self.mallinfo: dict[str, int] = {}  # glibc mallinfo2: bytes in use
        self.rss: dict[str, int] = {}       # kernel: VmRSS
        self.rss_peaks: dict[str, int] = {}  # kernel: VmHWM over a window
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = self._Mallinfo2
        self._libc = libc
        self._count = load_memcount()
        if self._count is None:
            raise RuntimeError("ProcessMeter needs memcount.so preloaded: build it with build_memcount() and start "
                               "the process with LD_PRELOAD=<path>/memcount.so")
        self._base = {}

    def _mallinfo2(self) -> int:
        m = self._libc.mallinfo2()
        return m.uordblks + m.hblkhd  # arena chunks in use + mmapped chunks

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def _now(self) -> dict[str, int]:
        return {"count": self._count.memcount_current(), "mallinfo": self._mallinfo2(),
                "rss": self._status("VmRSS")}

    def start(self) -> None:
        self._base = self._now()
        self.mark("start")

    def mark(self, name: str) -> None:
        now = self._now()
        self.levels[name] = now["count"] - self._base["count"]
        self.mallinfo[name] = now["mallinfo"] - self._base["mallinfo"]
        self.rss[name] = now["rss"] - self._base["rss"]

    def begin_window(self, name: str) -> None:
        self.mark(name + ":begin")
        self._count.memcount_reset_peak()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now (Linux >= 4.0)

    def end_window(self, name: str) -> None:
        self.peaks[name] = self._count.memcount_peak() - self._base["count"]
        self.rss_peaks[name] = self._status("VmHWM") - self._base["rss"]
        self.mark(name + ":end")

    def stop(self) -> None:
        pass


def load_memcount():
    """``memcount.so``'s counters if the process was started with it in ``LD_PRELOAD``, else None."""
    try:
        lib = ctypes.CDLL(None)
        lib.memcount_current.restype = lib.memcount_peak.restype = ctypes.c_int64
    except AttributeError:
        return None
    return lib


def build_memcount(out_dir) -> str | None:
    """Compile ``memcount.c`` into ``out_dir``; the path of the library, or None without a C compiler."""
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = Path(__file__).with_name("memcount.c"), Path(out_dir) / "memcount.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


class CudaMeter:
    name = "CUDA caching allocator (memory_allocated / max_memory_allocated)"

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._base = 0

    def start(self) -> None:
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()
        self.mark("start")

    def mark(self, name: str) -> None:
        torch.cuda.synchronize()
        self.levels[name] = torch.cuda.memory_allocated() - self._base
        self.reserved[name] = torch.cuda.memory_reserved()

    def begin_window(self, name: str) -> None:
        self.mark(name + ":begin")
        torch.cuda.reset_peak_memory_stats()

    def end_window(self, name: str) -> None:
        torch.cuda.synchronize()
        self.peaks[name] = torch.cuda.max_memory_allocated() - self._base
        self.mark(name + ":end")

    def stop(self) -> None:
        pass


METERS = {"alloc": AllocatorTimeline, "process": ProcessMeter, "cuda": CudaMeter}


def self_check(meter, device: str = "cpu", mib: int = 100) -> dict[str, float]:
    """Measure a known allocation (``mib`` MiB, every page written) with ``meter``; MiB out."""
    meter.start()
    meter.begin_window("check")
    t = torch.ones(mib * MIB, dtype=torch.uint8, device=device)
    meter.mark("check:alive")
    del t
    meter.end_window("check")
    meter.stop()
    out = {"alive": meter.levels["check:alive"] / MIB, "peak": meter.peaks["check"] / MIB,
           "after_free": meter.levels["check:end"] / MIB}
    if isinstance(meter, ProcessMeter):
        out |= {"mallinfo_alive": meter.mallinfo["check:alive"] / MIB, "rss_peak": meter.rss_peaks["check"] / MIB}
    return out


if __name__ == "__main__":
    # LD_PRELOAD=benchmarks/out/memcount.so python benchmarks/memory_meter.py: check each CPU meter
    for key in ("alloc", "process"):
        meter = METERS[key]()
        print(key, meter.name, self_check(meter))
