"""Build a small C source into a shared library once, cache it, load it with ctypes.

Shared by every native kernel (serving kernels here, the quantizer's in
:mod:`embedq.quant.native`). A library is keyed by its source, flags, compiler and the CPU
flags (``-march=native`` code must not run on another CPU), kept in
:func:`kernel_cache_dir`, and written atomically (concurrent builders are harmless).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

import torch

# OpenMP for the kernels' fan-out (eq_parallel.h): torch's own libgomp team; a compiler
# without it builds the pthread fan-out instead.
OPENMP = ["-fopenmp"]
_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def c_source(path: Path) -> str:
    """A kernel's C source with its local headers (``#include "x.h"`` beside it) inlined:
    the cache key then covers them, and the compiler needs no include path."""
    return _INCLUDE.sub(lambda m: (path.parent / m.group(1)).read_text(), path.read_text())


# How a kernel reads a scale tensor's dtype (every C kernel of embedq uses these codes).
SCALE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def compiler() -> str | None:
    """The C compiler to use (``$CC``, cc, gcc, clang), or None."""
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpuinfo_line(*keys: str) -> str | None:
    """The first /proc/cpuinfo line starting with one of ``keys`` (None: none, or no file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(keys)), None)
    except OSError:
        return None


def cpu_ident() -> str:
    """The CPU's feature flags (part of every library's cache key)."""
    line = _cpuinfo_line("flags", "Features")
    if line is not None:
        return line
    import platform
    return platform.machine() + platform.processor()


# CPU properties that are not /proc/cpuinfo flags but decide a dispatch row: the vendor
# (instruction rates differ: one zmm vdpbf16ps costs four FMAs' time on an Emerald Rapids,
# on Zen 4 one; scripts/vec_rates.c). Named like flags, so EMBEDQ_CPU_FEATURES can take
# them away too (``-vendor_intel``: an Intel CPU served in the order of the other vendors).
VENDOR_FLAGS = {"GenuineIntel": "vendor_intel", "AuthenticAMD": "vendor_amd"}


def _vendor_flag() -> str | None:
    line = _cpuinfo_line("vendor_id")
    return None if line is None else VENDOR_FLAGS.get(line.split(":", 1)[-1].strip())


@lru_cache(maxsize=1)
def _hardware_flags() -> frozenset[str]:
    vendor = _vendor_flag()
    return frozenset(cpu_ident().split(":", 1)[-1].split()) | ({vendor} if vendor else set())


def cpu_flags() -> set[str]:
    """The CPU features embedq's kernels may use: the hardware's, minus what
    ``EMBEDQ_CPU_FEATURES`` takes away.

    ``EMBEDQ_CPU_FEATURES`` lets one machine test every route it can run (an AVX512-BF16
    CPU also runs the AVX2 and portable variants): comma- or space-separated tokens,
    ``-flag`` removes a feature (``-avx512_bf16``, ``-avx512f``), a bare list keeps only
    the named features the hardware has (``avx2,fma,f16c``; ``none`` = no SIMD features).
    A feature the hardware lacks is never added (the code would not run).
    """
    hw = _hardware_flags()
    spec = os.environ.get("EMBEDQ_CPU_FEATURES", "").replace(",", " ").split()
    if not spec:
        return set(hw)
    keep = {t for t in spec if not t.startswith("-")}
    out = hw & keep if keep else set(hw)
    if "none" in keep:
        out = set()
    return out - {t[1:] for t in spec if t.startswith("-")}


def kernel_cache_dir() -> Path:
    """Where built kernels are kept (``EMBEDQ_KERNEL_CACHE``; default ``~/.cache/embedq/kernels``)."""
    env = os.environ.get("EMBEDQ_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    root = os.environ.get("EMBEDQ_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "embedq") / "kernels"


def cache_path(name: str, ident: object, suffix: str) -> Path:
    """The one cache key of every built kernel (C libraries, the quantizer's AOTI packages):
    ``<kernel_cache_dir>/<name>-<sha256(repr(ident))[:24]><suffix>``."""
    return kernel_cache_dir() / f"{name}-{hashlib.sha256(repr(ident).encode()).hexdigest()[:24]}{suffix}"


def publish(path: Path, make) -> None:
    """``make(tmp)`` writes the artifact to a temporary beside ``path``, which is then
    renamed into place: atomic, so concurrent builders are harmless and a killed one never
    leaves a half-written file under the cached name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp{path.suffix}")
    try:
        make(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def library_path(name: str, source: str, flags: list[str], cc: str) -> Path:
    return cache_path(name, (source, flags, cc, os.path.getmtime(cc) if os.path.exists(cc) else 0,
                             cpu_ident(), sys.platform), ".so")


class CompileError(RuntimeError):
    """The compiler rejected the source with these flags (deterministic: same key, same error)."""


def _build(cc: str, source: str, flags: list[str], libs: list[str], path: Path) -> None:
    def make(tmp: Path) -> None:
        src = tmp.with_suffix(".c")
        try:
            src.write_text(source)
            r = subprocess.run([cc, *flags, "-o", str(tmp), str(src), *libs],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise CompileError(((r.stderr or r.stdout).strip().splitlines() or ["cc failed"])[-1])
        finally:
            src.unlink(missing_ok=True)
    publish(path, make)


def load_library(name: str, source: str, flags: list[str], libs: list[str] = (),
                 remember_failure: bool = False) -> ctypes.CDLL:
    """Build (once per machine) and load; raises on any failure (the caller falls back).

    ``remember_failure``: a compile error is kept beside the library's cache name (a
    ``.failed`` file, same key) and raised again without compiling — for optional builds
    (OpenMP) that would otherwise cost every new process a failed compile."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    path = library_path(name, source, list(flags), cc)
    failed = path.with_suffix(".failed")
    if remember_failure and failed.is_file():
        raise CompileError(failed.read_text(errors="replace").strip() or "cc failed (cached)")
    if not path.is_file():
        try:
            _build(cc, source, list(flags), list(libs), path)
        except CompileError as e:
            if remember_failure:
                try:
                    publish(failed, lambda tmp: tmp.write_text(f"{e}\n"))
                except OSError:
                    pass  # a read-only cache: the next process compiles again
            raise
    return ctypes.CDLL(str(path))


class LazyLibrary:
    """One C kernel library: built and loaded on first use, at most once per process.

    ``needs``: CPU features (:func:`cpu_flags` names) the code requires, checked on every
    call (``EMBEDQ_CPU_FEATURES`` may change between loads); ``machines``: the
    ``platform.machine()`` values it compiles for (empty: any); ``setup(lib)`` declares the
    ctypes signatures; ``openmp``: build with :data:`OPENMP` (the fan-out of
    ``eq_parallel.h`` on torch's thread team), falling back to a build without it.
    :meth:`get` returns the library or None; :meth:`unavailable` why not.
    """

    def __init__(self, name: str, source, flags: list[str], libs: list[str] = (),
                 needs: tuple[str, ...] = (), machines: tuple[str, ...] = (), setup=None,
                 label: str | None = None, openmp: bool = False) -> None:
        self.label = label or name
        self.openmp = openmp
        self.name, self._source, self.flags, self.libs = name, source, list(flags), list(libs)
        self.needs, self.machines, self._setup = tuple(needs), tuple(machines), setup
        self._lock = threading.Lock()
        self._lib = None  # ctypes library, or False when it failed to build/load
        self._reason: str | None = None

    def _refused(self) -> str | None:
        import platform
        if self.machines and platform.machine().lower() not in self.machines:
            return f"not {'/'.join(self.machines)} ({platform.machine()})"
        missing = [f for f in self.needs if f not in cpu_flags()]
        return f"CPU lacks {', '.join(missing)}" if missing else None

    def get(self) -> ctypes.CDLL | None:
        if self._refused():
            return None
        with self._lock:
            if self._lib is None:
                try:
                    src = self._source() if callable(self._source) else self._source
                    lib = None
                    if self.openmp:
                        try:
                            lib = load_library(self.name, src, [*self.flags, *OPENMP], self.libs,
                                               remember_failure=True)
                        except Exception:  # noqa: BLE001 - no OpenMP here: the pthread fan-out
                            pass
                    if lib is None:
                        lib = load_library(self.name, src, self.flags, self.libs)
                    if self._setup is not None:
                        self._setup(lib)
                    self._lib = lib
                except Exception as e:  # noqa: BLE001 - any failure means: use another kernel
                    self._reason = f"{e}"
                    self._lib = False
            return self._lib or None

    def loaded(self) -> ctypes.CDLL | None:
        """The library once :meth:`get` has loaded it, without the CPU checks (a kernel's per-call
        path: its row was chosen at load; ``platform.machine()`` and the feature list cost ~80 us
        a decode step with the caches cold), else :meth:`get`."""
        return self._lib or self.get()

    def unavailable(self) -> str | None:
        """None when the library runs here, else why not (one line)."""
        why = self._refused()
        if why is None and self.get() is None:
            why = self._reason
        return None if why is None else f"{self.label} kernel unavailable: {why}"

    def reset(self) -> None:
        """Forget a failed (or successful) load: the next :meth:`get` builds again (tests)."""
        with self._lock:
            self._lib, self._reason = None, None


__all__ = ["CompileError", "LazyLibrary", "OPENMP", "SCALE_KIND", "c_source", "cache_path", "compiler",
           "cpu_ident", "cpu_flags", "kernel_cache_dir", "library_path", "load_library", "publish"]
