"""Test-only (tests/test_faults.py): a process on a filesystem without hard links (exFAT,
some FUSE and network mounts): every ``os.link`` fails with EPERM, as there."""
import errno
import os


def _no_link(*args, **kwargs):
    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


os.link = _no_link
