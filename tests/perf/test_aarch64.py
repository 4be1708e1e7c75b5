"""The portable C kernel on aarch64 (cross-compiled, run under qemu-user), and the same C-level
check natively for this CPU's builds.

``native_f32_check.c`` packs random codes as the overlay stores them, decodes them with a
C reference of the decoder and compares the kernel's logits for every scheme x M in
{1, 2, 3, 8, 17} x odd shapes (its header derives the bound), and the int8-activation
entry (``head_q4a8``) for every 4-bit grouped scheme. Speed on ARM is not
measured here (qemu emulates); correctness of the very code ARM CPUs build is.
The aarch64 case needs Debian's gcc-aarch64-linux-gnu and qemu-user
(``scripts/setup_aarch64.sh`` installs them) and skips, naming them, only when absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import clients
import pytest

from embedq.kernels import native_f32
from embedq.kernels.build import compiler, cpu_flags

CHECK = Path(__file__).with_name("native_f32_check.c")
FLAGS = ["-O3", "-std=gnu11", "-pthread"]


def _build_and_run(cc: str, flags: list[str], out: Path, runner: list[str]) -> None:
    r = subprocess.run([cc, *FLAGS, *flags, "-o", str(out), str(CHECK), str(native_f32.SOURCE), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "0 of 110 cases failed" in r.stdout, r.stdout[-3000:] + r.stderr[-1000:]


def test_portable_kernel_on_aarch64_under_qemu(tmp_path):
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        missing = [n for n, p in (("gcc-aarch64-linux-gnu", cc), ("qemu-user", qemu)) if p is None]
        clients.unavailable("aarch64 toolchain", f"{', '.join(missing)} absent: run scripts/setup_aarch64.sh",
                            clients.CACHE / "logs" / "aarch64.log")
    # static: qemu-user needs no aarch64 sysroot at run time; plain -O3 = the portable build
    _build_and_run(cc, ["-static"], tmp_path / "check-aarch64", [qemu])


@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_c_check_natively(variant, tmp_path):
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler found")
    flags = native_f32.VARIANTS[variant].flags
    if variant == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip(f"avx2 build: {native_f32.VARIANTS['avx2'].unavailable()}")
    _build_and_run(cc, [f for f in flags if f.startswith("-m")], tmp_path / f"check-{variant}", [])
