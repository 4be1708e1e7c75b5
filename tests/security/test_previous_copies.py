"""``.embedq/previous/`` kept as copies (a filesystem without hard links, or none usable):
the originals a copy was kept from are freed by the commit, so their identities ("live")
name nothing after the switch-off, and a file the commit writes later may get the very
inode number back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from faultutil import embedq, leftovers, settled, tree

NO_LINKS = Path(__file__).resolve().parents[1] / "data" / "nolinks"  # os.link fails (EPERM)
KIND = "llama_untied_fp32"  # one model.safetensors, no index: config.json is the 3rd file written


@pytest.fixture
def no_links(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(NO_LINKS), os.environ.get("PYTHONPATH")))))


def _ident(p: Path) -> list[int]:
    st = os.lstat(p)
    return [st.st_dev, st.st_ino, st.st_size]


def _outside(t: dict[str, str]) -> dict[str, str]:
    """The model's own files: all but ``.embedq/`` and leftover staging."""
    return {k: v for k, v in settled(t).items() if not k.startswith(".embedq/")}


def _requantize(model_factory, tmp_path):
    """(reset to an 8-bit in-place overlay, the 4-bit --force args, old tree, new tree)."""
    first, m = tmp_path / "first", tmp_path / "m"
    shutil.copytree(model_factory(KIND), first, symlinks=True)
    assert embedq("quantize", first, "-q", "--lm-head", "--bits", "8").returncode == 0
    old = tree(first)

    def reset():
        shutil.rmtree(m, ignore_errors=True)
        shutil.copytree(first, m, symlinks=True)
    args = ("quantize", m, "-q", "--lm-head", "--bits", "4", "--force")
    reset()
    assert embedq(*args).returncode == 0
    return m, reset, args, old, tree(m)


def _killed_after_switch(m, reset, args, new):
    """Kill the re-commit at its last commit: config.json is the new one, the journal not
    yet dropped (the kept copies still in previous/)."""
    for n in range(1, 12):
        reset()
        r = embedq(*args, kill_at=f"committed:{n}")
        assert r.returncode == -9, (n, r.stderr)
        if _outside(tree(m)) == _outside(new):
            assert (m / ".embedq" / "previous" / "journal.json").exists(), n
            return n
    raise AssertionError("never killed after the switch")


def test_no_links_killed_after_switch_new_overlay_stays(model_factory, tmp_path, no_links):
    """Killed after config.json's switch (only the kept copies left to drop): the new overlay
    is complete, so readers take it and the next locked run keeps it (the journal docs: "unless
    the kill came after config.json's switch (the new overlay is complete and stays)").
    On ext4 the new config.json usually gets the inode number the switched-off config.json
    freed, with the same size (bits 8 -> 4): its identity equals the journal's "live" one."""
    from embedq.format import kept
    m, reset, args, old, new = _requantize(model_factory, tmp_path)
    _killed_after_switch(m, reset, args, new)
    live = json.loads((m / ".embedq/previous/journal.json").read_text())["live"]
    reused = live["config.json"] == _ident(m / "config.json")  # what the filesystem did
    assert kept.decide(m)[0] == "complete", ("reused inode" if reused else "", kept.decide(m))
    assert embedq("verify", m).returncode == 0
    r = embedq("remove", m)  # locked: must not put the 8-bit overlay back first
    assert r.returncode == 0 and "is back" not in r.stderr, r.stderr


def test_no_links_reused_config_inode_is_not_between_overlays(model_factory, tmp_path, no_links):
    """The same, deterministic: the journal's "live" config.json identity is what the new
    config.json has (the freed inode number reused, as ext4 does), everything else as the
    killed commit left it. Not "restore": the new overlay is complete."""
    from embedq.format import kept
    m, reset, args, old, new = _requantize(model_factory, tmp_path)
    _killed_after_switch(m, reset, args, new)
    j = m / ".embedq/previous/journal.json"
    journal = json.loads(j.read_text())
    journal["live"]["config.json"] = _ident(m / "config.json")
    j.write_text(json.dumps(journal))
    assert kept.decide(m)[0] == "complete"
    r = embedq("verify", m)
    assert r.returncode == 0, r.stderr
    assert embedq("quantize", m, "-q", "--lm-head", "--bits", "4").returncode == 2  # refused, settled
    assert settled(tree(m)) == settled(new) and not leftovers(m)


def _mounted_state_dir(m: Path):
    """``m/.embedq`` on its own filesystem (a tmpfs), its files kept: os.link into it is EXDEV."""
    saved = m.parent / "saved-state"
    shutil.copytree(m / ".embedq", saved)
    r = subprocess.run(["mount", "-t", "tmpfs", "embedq-test", str(m / ".embedq")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()[:80]}")
    for f in saved.iterdir():
        shutil.copy2(f, m / ".embedq" / f.name)


def test_previous_on_another_filesystem_is_put_back(model_factory, tmp_path):
    """``.embedq/`` on another filesystem (a mount): os.link fails with EXDEV and the old
    overlay is copied there, but a copy on another filesystem cannot be put back by a
    rename. A kill between the two overlays must still end with the old overlay (or the
    new one) after the next locked run, never a folder every run fails on."""
    m = tmp_path / "m"
    shutil.copytree(model_factory(KIND), m, symlinks=True)
    pristine = _outside(tree(m))
    assert embedq("quantize", m, "-q", "--lm-head", "--bits", "8").returncode == 0
    _mounted_state_dir(m)
    try:
        r = embedq("quantize", m, "-q", "--lm-head", "--bits", "4", "--force", kill_at="committed:3")
        assert r.returncode == -9, r.stderr
        r = embedq("remove", m)  # locked: settles the folder first, then removes the overlay
        assert r.returncode == 0, r.stderr
        assert _outside(tree(m)) == pristine and not os.path.lexists(m / ".embedq" / "previous")
    finally:
        subprocess.run(["umount", str(m / ".embedq")], check=False)
