"""``.embedq/previous/`` (jobs/previous.py) as untrusted input: a journal is used only for
the very inodes it recorded, so a folder that arrives with one (downloaded, copied) never
has files renamed over its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from faultutil import embedq, one_error_line, tree

KIND = "llama_untied_sharded"


def _overlaid(model_factory, tmp_path):
    m = tmp_path / "m"
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_factory(KIND), m, symlinks=True)
    assert embedq("quantize", m, "-q", "--lm-head", "--bits", "8").returncode == 0
    return m


def test_forged_journal_is_dropped(model_factory, tmp_path):
    m = _overlaid(model_factory, tmp_path)
    prev = m / ".embedq" / "previous"
    prev.mkdir()
    (prev / "config.json").write_text('{"model_type": "forged"}')
    (prev / "quantization_config.json").write_text('{"quant_method": "embedq"}')
    (prev / "embedq.safetensors").write_bytes(b"x")
    st = os.lstat(prev / "config.json")
    files = {n: [st.st_dev, st.st_ino + 1, st.st_size] for n in
             ("config.json", "quantization_config.json", "embedq.safetensors")}
    (prev / "journal.json").write_text(json.dumps({"format_version": 1, "files": files}))
    before = {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")}
    r = embedq("quantize", m, "-q", "--lm-head", "--bits", "8")  # refused: an overlay is there
    assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, r.stderr
    assert "not this folder's own" in r.stderr and "not put back" in r.stderr, r.stderr
    assert {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")} == before
    assert not prev.exists()


def test_copied_killed_folder_reads_as_its_files(model_factory, tmp_path):
    """A killed re-commit copied elsewhere: the copy's journal names other inodes, so the
    copy keeps the files it has (the original model) and drops the journal."""
    m = _overlaid(model_factory, tmp_path)
    r = embedq("quantize", m, "-q", "--lm-head", "--bits", "4", "--force", kill_at="committed:2")
    assert r.returncode == -9 and (m / ".embedq" / "previous" / "journal.json").exists()
    copy = tmp_path / "copy"
    shutil.copytree(m, copy, symlinks=True)
    before = {k: v for k, v in tree(copy).items() if not k.startswith(".embedq/")}
    assert "quantization_config.json" not in before  # switched off when it was killed
    r = embedq("remove", copy)
    assert r.returncode == 0, r.stderr
    assert not (copy / ".embedq").exists() and "quantization_config.json" not in tree(copy)
    assert embedq("remove", m).returncode == 0  # the original folder: put back, then removed
    assert tree(m) == tree(model_factory(KIND))


def _plant(m, what):
    prev = m / ".embedq" / "previous"
    if what == "fifo previous":
        os.mkfifo(prev)
        return
    prev.mkdir()
    j = prev / "journal.json"
    if what == "fifo journal":
        os.mkfifo(j)
    elif what == "journal folder":
        j.mkdir()
        (j / "x").write_text("{}")
    elif what == "link journal":
        (m.parent / "elsewhere.json").write_text('{"files": {}}')
        j.symlink_to(m.parent / "elsewhere.json")


def test_odd_previous_never_hangs_or_sticks(model_factory, tmp_path):
    """A FIFO (which a plain open() would block on), a folder or a link where the journal
    or ``previous/`` goes: each run drops it and goes on; nothing outside is touched."""
    for what in ("fifo journal", "journal folder", "fifo previous", "link journal"):
        m = _overlaid(model_factory, tmp_path / what.replace(" ", "_"))
        _plant(m, what)
        before = {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")}
        r = embedq("quantize", m, "-q", "--lm-head", "--bits", "8", timeout=60)
        assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, (what, r.stderr)
        assert not os.path.lexists(m / ".embedq" / "previous"), what
        assert {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")} == before, what
        if what == "link journal":
            assert (m.parent / "elsewhere.json").read_text() == '{"files": {}}'
        assert embedq("remove", m).returncode == 0, what


def test_deep_previous_is_one_line_naming_it(model_factory, tmp_path):
    """A ``previous/`` too deep for rmtree: one line naming it and the fix, not "unexpected"."""
    m = _overlaid(model_factory, tmp_path)
    d = m / ".embedq" / "previous"
    deep = d
    d.mkdir()
    for _ in range(1200):  # os.makedirs itself recurses
        deep = deep / "d"
        deep.mkdir()
    try:
        r = embedq("quantize", m, "-q", "--lm-head", "--bits", "8", "--force")
        one_error_line(r, str(d), "delete it by hand")
    finally:  # bottom-up, always: pytest's own cleanup of old runs would recurse too deep
        subprocess.run(["rm", "-rf", str(d)], check=True)
    assert embedq("quantize", m, "-q", "--lm-head", "--bits", "8", "--force").returncode == 0


def test_journal_file_not_recorded_is_not_put_back(model_factory, tmp_path):
    """A journal whose config.json entry matches the folder's own file ("already put back")
    never makes embedq rename a ``previous/config.json`` it did not record."""
    m = _overlaid(model_factory, tmp_path)
    prev = m / ".embedq" / "previous"
    prev.mkdir()
    (prev / "config.json").write_text('{"model_type": "forged"}')
    files = {n: list((lambda st: [st.st_dev, st.st_ino, st.st_size])(os.lstat(m / n)))
             for n in ("config.json", "quantization_config.json", "embedq.safetensors")}
    os.link(m / "embedq.safetensors", prev / "embedq.safetensors")
    (m / "quantization_config.json").rename(prev / "quantization_config.json")  # "switched off"
    (prev / "journal.json").write_text(json.dumps({"format_version": 1, "files": files}))
    r = embedq("remove", m)
    assert r.returncode == 0, r.stderr
    assert "forged" not in (m / "config.json").read_text()
    assert tree(m) == tree(model_factory(KIND))


def test_journal_naming_another_file_is_dropped(model_factory, tmp_path):
    """A journal may name only the four files an overlay commit changes: one that also names
    a shard (its recorded inode a file planted in ``previous/``) is dropped whole, with the
    line saying so, and the shard is never replaced."""
    m = _overlaid(model_factory, tmp_path)
    shard = sorted(p.name for p in m.glob("model-*.safetensors"))[0]
    prev = m / ".embedq" / "previous"
    prev.mkdir()
    (prev / shard).write_bytes(b"planted weights")
    files = {n: list((lambda st: [st.st_dev, st.st_ino, st.st_size])(os.lstat(m / n)))
             for n in ("config.json", "quantization_config.json", "embedq.safetensors")}
    st = os.lstat(prev / shard)
    files[shard] = [st.st_dev, st.st_ino, st.st_size]
    (prev / "journal.json").write_text(json.dumps({"format_version": 1, "files": files}))
    before = tree(m)[shard]
    r = embedq("remove", m)
    assert r.returncode == 0, r.stderr
    assert "not put back" in r.stderr and "is back" not in r.stderr, r.stderr
    assert tree(m)[shard] == before
    assert tree(m) == tree(model_factory(KIND))


def test_previous_without_a_journal_is_dropped_silently(model_factory, tmp_path):
    """A ``previous/`` holding no journal (a run killed while keeping, before anything was
    switched) is deleted unused and without a line; its files are never put back."""
    m = _overlaid(model_factory, tmp_path)
    prev = m / ".embedq" / "previous"
    prev.mkdir()
    (prev / "config.json").write_text('{"model_type": "forged"}')
    before = {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")}
    r = embedq("quantize", m, "-q", "--lm-head", "--bits", "8")  # refused: an overlay is there
    assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and ".embedq/previous" not in r.stderr, r.stderr
    assert not os.path.lexists(prev)
    assert {k: v for k, v in tree(m).items() if not k.startswith(".embedq/")} == before


def test_a_file_slipped_into_previous_never_costs_the_put_back_config(model_factory, tmp_path):
    """Recovery half done (the old quantization_config.json already put back), then a file
    placed at previous/quantization_config.json that the journal did not record: the put-back
    config stays (it was unlinked as "the new one" before, and nothing replaced it)."""
    import shutil
    from faultutil import embedq
    m = tmp_path / "m"
    shutil.copytree(model_factory("qwen2_tied"), m)
    assert embedq("quantize", m, "-q", "--bits", "8").returncode == 0
    old_qc = (m / "quantization_config.json").read_bytes()
    assert embedq("quantize", m, "-q", "--bits", "4", "--force", kill_at="committed:3").returncode == -9
    # the next run killed after putting back the old config (the new one unlinked first)
    r = embedq("remove", m, kill_at="committed:2")
    assert r.returncode == -9, r.stderr
    assert (m / "quantization_config.json").read_bytes() == old_qc
    (m / ".embedq" / "previous" / "quantization_config.json").write_bytes(old_qc)  # unrecorded
    r = embedq("quantize", m, "-q", "--bits", "8")  # recovers, then refuses: an overlay is there
    assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, r.stderr
    assert (m / "quantization_config.json").read_bytes() == old_qc


def test_lock_text_round_trips(model_factory, tmp_path):
    """The lock file's text is written and read in one place (format/constants.py): what
    folder_lock writes names its holder to readers; any other text (an emptied file, a
    foreign or forged one) names no pid, so no reader probes one it does not name."""
    from embedq.format.constants import lock_pid, lock_text
    from embedq.format.kept import _committing
    from embedq.jobs.state import folder_lock
    for pid, verb in ((1, "quantize"), (os.getpid(), "apply"), (4194304, "remove")):
        assert lock_pid(lock_text(pid, verb)) == pid
    for text in ("", "\n", "another process", "pid", "pid 12", "pid x, embedq quantize",
                 "pid 0, embedq quantize", "pid -1, embedq quantize", "pid \u00b2, embedq quantize"):
        assert lock_pid(text) is None, text
    m = tmp_path / "m"
    shutil.copytree(model_factory(KIND), m, symlinks=True)
    with folder_lock(m, "quantize"):
        text = (m / ".embedq" / "lock").read_text()
        assert text == lock_text(os.getpid(), "quantize")
        assert _committing(m) == text.strip()
    assert _committing(m) is None  # emptied (or removed) on release
