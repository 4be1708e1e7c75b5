"""CPU seconds per stage and per thread (``EMBEDQ_PROFILE=1`` or ``embedq quantize --profile``).

Every stage is timed with ``getrusage(RUSAGE_THREAD)`` of the thread that runs it (user +
system CPU, minor/major page faults) and the wall clock. Stages nest: a stage's *self*
time excludes the stages inside it, so the rows add up. At exit the table is printed to
stderr with the process's own ``getrusage(RUSAGE_SELF)`` (plus children: the C compiler)
beside it; what no stage claims is shown as ``(unattributed)`` per thread, and CPU of
threads embedq did not start (torch's intra-op pool, ...) as ``other threads``.

``EMBEDQ_PROFILE=<path>.json`` also writes the rows as JSON there. Disabled, a stage costs
one attribute lookup and a shared null context.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import sys
import threading
import time

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)
_NULL = contextlib.nullcontext()


def _usage(who) -> tuple[float, int, int]:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_majflt


def _thread_usage() -> tuple[float, int, int]:
    # CPU from CLOCK_THREAD_CPUTIME_ID: getrusage's thread times advance only at scheduler
    # ticks (4 ms), too coarse for stages of a few milliseconds. Faults from getrusage.
    if _RUSAGE_THREAD is None:  # not Linux: CPU only
        return time.thread_time(), 0, 0
    r = resource.getrusage(_RUSAGE_THREAD)
    return time.thread_time(), r.ru_minflt, r.ru_majflt


def _process_start_wall() -> float:
    """Seconds since this process started (from /proc), else since this module loaded."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - start / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Profile:
    """Accumulates ``(thread, stage) -> [cpu s, wall s, minor faults, major faults, calls]``."""

    def __init__(self) -> None:
        self.enabled = False
        self.rows: dict[tuple[str, str], list] = {}
        self.threads: dict[str, list] = {}  # thread name -> [cpu, minflt, majflt] at its end
        self._local = threading.local()
        self._lock = threading.Lock()
        self.wall0 = time.perf_counter() - _process_start_wall()

    def enable(self, dest: str | None = None) -> None:
        if self.enabled:
            return
        self.enabled = True
        self.dest = dest
        # What the main thread spent before profiling began: interpreter start-up and the
        # imports that ran before this call.
        cpu, mn, mj = _thread_usage()
        self._add(threading.current_thread().name, "start-up: interpreter + imports before the command",
                  cpu, time.perf_counter() - self.wall0, mn, mj)
        atexit.register(self.report)

    def stage(self, name: str):
        """A context manager timing ``name`` on the calling thread (a no-op when disabled)."""
        return _Stage(self, name) if self.enabled else _NULL

    def thread_done(self) -> None:
        """Record the calling thread's total usage (call last thing in a thread embedq starts)."""
        if not self.enabled:
            return
        cpu, mn, mj = _thread_usage()
        with self._lock:
            t = self.threads.setdefault(threading.current_thread().name, [0.0, 0, 0])
            t[0] += cpu
            t[1] += mn
            t[2] += mj

    def _add(self, thread: str, stage: str, cpu: float, wall: float, mn: int, mj: int) -> None:
        with self._lock:
            r = self.rows.setdefault((thread, stage), [0.0, 0.0, 0, 0, 0])
            r[0] += cpu
            r[1] += wall
            r[2] += mn
            r[3] += mj
            r[4] += 1

    # --- the report -------------------------------------------------------------------

    def table(self) -> dict:
        """Rows (with the unattributed remainders) and the process totals."""
        main = threading.main_thread().name
        cpu, mn, mj = _thread_usage() if threading.current_thread() is threading.main_thread() \
            else (None, 0, 0)
        threads = {k: list(v) for k, v in self.threads.items()}
        if cpu is not None:
            threads[main] = [cpu, mn, mj]
        rows = [{"thread": t, "stage": s, "cpu_s": r[0], "wall_s": r[1], "minor_faults": r[2],
                 "major_faults": r[3], "calls": r[4]} for (t, s), r in self.rows.items()]
        for t, (tc, tmn, tmj) in threads.items():
            mine = [r for r in rows if r["thread"] == t]
            rest = tc - sum(r["cpu_s"] for r in mine)
            rows.append({"thread": t, "stage": "(unattributed)", "cpu_s": rest, "wall_s": None,
                         "minor_faults": tmn - sum(r["minor_faults"] for r in mine),
                         "major_faults": tmj - sum(r["major_faults"] for r in mine), "calls": None})
        _, pmn, pmj = _usage(resource.RUSAGE_SELF)
        pself = time.process_time()  # all threads, precise (getrusage's is tick-based)
        child, _, _ = _usage(resource.RUSAGE_CHILDREN)
        # Threads without a recorded total (a pool's): their stages are named; the rest of
        # the process CPU is theirs or foreign (torch's intra-op pool, ...).
        known = sum(v[0] for v in threads.values()) + sum(
            r["cpu_s"] for r in rows if r["thread"] not in threads)
        rows.append({"thread": "other threads", "stage": "torch intra-op pool, ...", "cpu_s": pself - known,
                     "wall_s": None, "minor_faults": None, "major_faults": None, "calls": None})
        if child:
            rows.append({"thread": "child processes", "stage": "C compiler (native kernel build)",
                         "cpu_s": child, "wall_s": None, "minor_faults": None, "major_faults": None,
                         "calls": None})
        total = pself + child
        named = sum(r["cpu_s"] for r in rows if r["stage"] != "(unattributed)")
        return {"rows": rows, "process_cpu_s": total, "named_cpu_s": named,
                "coverage": named / total if total else 1.0, "wall_s": time.perf_counter() - self.wall0,
                "minor_faults": pmn, "major_faults": pmj}

    def report(self, file=None) -> dict:
        data = self.table()
        lines = [f"{'thread':<14} {'stage':<52} {'CPU s':>7} {'wall s':>7} {'minflt':>8} {'calls':>6}"]
        for r in data["rows"]:
            if abs(r["cpu_s"]) < 0.0005 and not r["minor_faults"]:
                continue
            wall = "" if r["wall_s"] is None else f"{r['wall_s']:.3f}"
            mf = "" if r["minor_faults"] is None else str(r["minor_faults"])
            calls = "" if r["calls"] is None else str(r["calls"])
            lines.append(f"{r['thread']:<14} {r['stage'][:52]:<52} {r['cpu_s']:>7.3f} {wall:>7} {mf:>8} {calls:>6}")
        lines.append(f"process CPU {data['process_cpu_s']:.3f} s (wall {data['wall_s']:.3f} s); named stages "
                     f"{data['named_cpu_s']:.3f} s = {100 * data['coverage']:.1f}%; "
                     f"{data['minor_faults']} minor faults")
        print("embedq profile (CPU seconds per stage and thread)\n" + "\n".join(lines),
              file=file or sys.stderr)
        if self.dest:
            with open(self.dest, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
        return data


class _Stage:
    __slots__ = ("p", "name", "start", "child")

    def __init__(self, p: Profile, name: str):
        self.p, self.name = p, name

    def __enter__(self):
        stack = getattr(self.p._local, "stack", None)
        if stack is None:
            stack = self.p._local.stack = []
        stack.append(self)
        self.child = [0.0, 0.0, 0, 0]
        cpu, mn, mj = _thread_usage()
        self.start = (cpu, time.perf_counter(), mn, mj)
        return self

    def __exit__(self, *exc):
        cpu, mn, mj = _thread_usage()
        wall = time.perf_counter()
        d = (cpu - self.start[0], wall - self.start[1], mn - self.start[2], mj - self.start[3])
        stack = self.p._local.stack
        stack.pop()
        if stack:  # the parent's self time excludes this stage
            for i in range(4):
                stack[-1].child[i] += d[i]
        self.p._add(threading.current_thread().name, self.name, d[0] - self.child[0],
                    d[1] - self.child[1], d[2] - self.child[2], d[3] - self.child[3])
        return False


PROFILE = Profile()
stage = PROFILE.stage


def from_env() -> None:
    """Enable profiling when ``EMBEDQ_PROFILE`` is set (``1``, or a JSON path)."""
    v = os.environ.get("EMBEDQ_PROFILE", "")
    if v and v != "0":
        PROFILE.enable(None if v in ("1", "true", "yes") else v)


from_env()

__all__ = ["PROFILE", "Profile", "stage", "from_env"]
