"""`embedq gguf` as a real process under kills, a full disk and a read-only folder
(the other verbs: tests/test_faults.py)."""

from __future__ import annotations

import shutil

from faultutil import embedq, one_error_line, read_only, sweep, tree


def test_gguf_killed_full_disk_read_only(tiny, tiny_overlays, tmp_path):
    _, base = tiny
    ov = tiny_overlays["q4"]
    dest = tmp_path / "out"
    dest.mkdir()
    out = dest / "t.gguf"
    args = ("gguf", base, "--overlay", ov, "-o", out, "--force")
    before = tree(base.parent), tree(ov)
    assert embedq(*args).returncode == 0
    new = tree(dest)

    def reset():
        shutil.rmtree(dest)
        dest.mkdir()

    # over an older OUT: killed with the new file staged (as large as the model, beside
    # OUT) or renamed — the old file or the new one, never a mix; the next run removes
    # the staged file
    def reset_old():
        reset()
        assert embedq("gguf", base, "--overlay", tiny_overlays["q8"], "-o", out).returncode == 0
    reset_old()
    older = tree(dest)
    assert older != new and sorted(older) == sorted(new)
    assert sweep(args, dest, reset_old, older, new) == 1
    reset()
    one_error_line(embedq(*args, fsize=16 << 10), str(out), "File too large")
    assert tree(dest) == {}
    with read_only(dest):
        one_error_line(embedq(*args), str(out))
    assert tree(dest) == {}
    assert (tree(base.parent), tree(ov)) == before
