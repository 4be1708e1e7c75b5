"""Every writing verb as a real process, under kills, Ctrl-C, a full disk and read-only folders.

Each case: the source is byte-identical afterwards; the destination holds the old state or
the complete new one (leftover staging aside); a rerun succeeds and leaves exactly a clean
run's files. (ONNX: tests/onnx/test_onnx_faults.py; GGUF: tests/gguf/test_gguf_faults.py.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from faultutil import embedq, leftovers, loaded_view, one_error_line, read_only, settled, sweep, tree

KIND = "llama_untied_sharded"  # embedding and head in different shards, 4 shards
NO_LINKS = Path(__file__).parent / "data" / "nolinks"  # its sitecustomize.py: os.link fails (EPERM)


@pytest.fixture(params=["links", "no-links"])
def fs(request, monkeypatch):
    """The model folder's filesystem as every embedq process sees it: with hard links, or
    without (exFAT, some FUSE mounts: the overlay a re-commit replaces is kept as copies)."""
    if request.param == "no-links":
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(NO_LINKS), os.environ.get("PYTHONPATH")))))
    return request.param


def _kept_as(model) -> str:
    """How ``.embedq/previous/`` holds the old overlay: "links" (each kept file the very inode
    it was kept from) or "no-links" (copies), as its journal records."""
    import json
    journal = json.loads((model / ".embedq" / "previous" / "journal.json").read_text())
    return "links" if journal["files"] == journal["live"] else "no-links"


@pytest.fixture(scope="module")
def bundle(model_factory, tmp_path_factory):
    """(pristine source, its overlay-only bundle, a derived checkpoint of it)."""
    root = tmp_path_factory.mktemp("faults")
    src = model_factory(KIND)
    ov, derived = root / "ov", root / "derived"
    assert embedq("quantize", src, "-q", "--lm-head", "--output", ov, "--overlay-only").returncode == 0
    assert embedq("quantize", src, "-q", "--lm-head", "--output", derived).returncode == 0
    return src, ov, derived


def _fresh(src, dst):
    def reset():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True)
    return reset


def _clean_run(reset, dest, *args):
    reset()
    r = embedq(*args)
    assert r.returncode == 0, r.stderr
    return tree(dest)


def test_apply_killed_at_every_commit(bundle, tmp_path):
    src, ov, _ = bundle
    base, before = tmp_path / "base", tree(src)
    reset = _fresh(src, base)
    args = ("apply", base, "--overlay", ov)
    new = _clean_run(reset, base, *args)
    ov_before = tree(ov)

    def overlay_untouched(n):
        assert tree(ov) == ov_before, n
    assert sweep(args, base, reset, before, new, view=loaded_view, extra=overlay_untouched) >= 3
    assert tree(src) == before


def test_remove_killed_at_every_commit(bundle, tmp_path):
    src, ov, _ = bundle
    base = tmp_path / "base"
    applied = tmp_path / "applied"
    _fresh(src, applied)()
    assert embedq("apply", applied, "--overlay", ov).returncode == 0
    reset = _fresh(applied, base)
    old = tree(applied)
    new = _clean_run(reset, base, "remove", base)
    assert new == tree(src)  # remove restores the source byte for byte, nothing of ours left
    assert sweep(("remove", base), base, reset, old, new, view=loaded_view) >= 1


@pytest.mark.parametrize("where", ["output", "in-place"])
def test_quantize_killed_at_every_commit(bundle, tmp_path, where):
    src, _, _ = bundle
    if where == "output":
        model, dest = src, tmp_path / "out"
        reset = lambda: shutil.rmtree(dest, ignore_errors=True)  # noqa: E731
        args = ("quantize", src, "-q", "--lm-head", "--output", dest)
        old, view = {}, None
    else:
        model = dest = tmp_path / "model"
        reset = _fresh(src, model)
        args = ("quantize", model, "-q", "--lm-head")
        old, view = tree(src), loaded_view
    before = tree(src)
    new = _clean_run(reset, dest, *args)
    assert sweep(args, dest, reset, old, new, view=view, stride=2) >= 1
    assert tree(src) == before
    assert not leftovers(tmp_path)


def _requantize(bundle, tmp_path):
    """(model reset to an 8-bit in-place overlay, the 4-bit --force args, old tree, new tree)."""
    src, _, _ = bundle
    first, model = tmp_path / "first", tmp_path / "model"
    _fresh(src, first)()
    assert embedq("quantize", first, "-q", "--lm-head", "--bits", "8").returncode == 0
    reset = _fresh(first, model)
    args = ("quantize", model, "-q", "--lm-head", "--bits", "4", "--force")
    return model, reset, args, tree(first), _clean_run(reset, model, *args)


def _interrupt_each_commit(args, model, reset, old, new):
    """Ctrl-C at each commit of ``embedq ARGS``: exit 130, the old tree exactly or the new
    one (the lock file aside), nothing staged left; some point gives the old one back."""
    seen = set()
    for n in range(1, 12):
        reset()
        r = embedq(*args, kill_at=f"committed:{n}", sig="INT")
        if r.returncode == 0:
            break
        assert r.returncode == 130 and "Traceback" not in r.stderr, (n, r.stderr)
        now = settled(tree(model))
        assert now in (settled(old), settled(new)), (n, sorted(set(now) ^ set(old)))
        seen.add("old" if now == settled(old) else "new")
        assert not leftovers(model), n
    assert n > 3 and "old" in seen, (n, seen)


def test_requantize_in_place_killed_at_every_commit(bundle, tmp_path, fs):
    """``quantize --force`` over an in-place overlay of other settings: after a kill a loader
    reads the old overlay, the new one, or (between the two) the original model; never the
    old settings (config.json's or quantization_config.json's) over the new tables. The next
    run on the folder puts the old overlay back before anything else (jobs/previous.py):
    rerun without --force, it is refused with the old overlay whole again."""
    src, _, _ = bundle
    pristine = tree(src)
    model, reset, args, old, new = _requantize(bundle, tmp_path)
    reset()
    assert embedq(*args, kill_at="committed:3").returncode == -9
    assert _kept_as(model) == fs
    original = pristine["config.json"]
    qc = "quantization_config.json"
    switch = ("config.json", "embedq.safetensors", qc)

    def view(t):
        if t.get("config.json") == original:  # config.json off: what embedq.load pairs with the
            return {k: v for k, v in t.items() if k in ("config.json", qc)}  # tables: quantization_config.json
        return {**loaded_view(t), **{k: t.get(k) for k in switch}}
    # the old overlay as config.json names it (its quantization_config.json gone first), the
    # original model with neither or with the new config beside the new tables
    between = ({k: v for k, v in old.items() if k != qc}, {"config.json": original},
               {"config.json": original, qc: new[qc]})

    def rerun_settles(at):
        # killed after config.json's switch: the new overlay is complete and stays
        expect = new if tree(model).get("config.json") == new["config.json"] else old
        v = embedq("verify", model)  # read only: says the folder is between two overlays
        assert (v.returncode == 0) == (expect is new or at in ("staged:1", "committed:1")), (at, v.stderr)
        if v.returncode:
            one_error_line(v, "between two overlays", "previous/")
        r = embedq(*args[:-1])  # without --force: recovers, then refuses (an overlay is there)
        assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, (at, r.stderr)
        assert settled(tree(model)) == settled(expect), at
        assert ("is back" in r.stderr) == (expect is old and at not in ("staged:1", "committed:1")), \
            (at, r.stderr)
    assert sweep(args, model, reset, old, new, view=view, also=between, extra=rerun_settles) >= 1
    assert tree(src) == pristine and not leftovers(tmp_path)


def test_requantize_recovery_killed_at_every_rename(bundle, tmp_path):
    """A second kill while the next run puts the old overlay back: at every point the files
    that pair (quantization_config.json with the tables; config.json's switch) belong to one
    overlay, and a third run finishes the recovery."""
    model, reset, args, old, new = _requantize(bundle, tmp_path)
    pair = ("config.json", "quantization_config.json", "embedq.safetensors")
    orig = tree(bundle[0])["config.json"]

    def state(t):
        return tuple(t.get(k) for k in pair)
    allowed = {(orig, None, new["embedq.safetensors"]), (orig, None, old["embedq.safetensors"]),
               (orig, old["quantization_config.json"], old["embedq.safetensors"]), state(old)}
    for k in range(1, 12):
        reset()
        assert embedq(*args, kill_at="committed:3").returncode == -9  # the new tables are in
        r = embedq(*args[:-1], kill_at=f"committed:{k}")
        if r.returncode != -9:
            assert r.returncode == 2 and "is back" in r.stderr, r.stderr
            break
        assert state(tree(model)) in allowed, k
        r = embedq(*args[:-1])
        assert r.returncode == 2 and "already has an embedq overlay" in r.stderr, (k, r.stderr)
        assert settled(tree(model)) == settled(old), k
    assert k >= 4, k  # the new config removed, then tables, config, index, config.json put back


def test_requantize_killed_after_switch_with_large_config(model_factory, tmp_path):
    """Killed after config.json's switch, a config.json over 1 MiB (long vocab lists): the
    new overlay is complete and stays (its size once hid the switch and rolled it back)."""
    import json
    first, model = tmp_path / "first", tmp_path / "model"
    shutil.copytree(model_factory("qwen2_tied"), first)
    cfg = json.loads((first / "config.json").read_text())
    cfg["padding_for_test"] = "x" * (1100 << 10)
    (first / "config.json").write_text(json.dumps(cfg))
    assert embedq("quantize", first, "-q", "--bits", "8").returncode == 0
    old_cfg = (first / "config.json").read_bytes()
    args = ("quantize", model, "-q", "--bits", "4", "--force")
    for n in range(1, 12):
        _fresh(first, model)()
        assert embedq(*args, kill_at=f"committed:{n}").returncode == -9, n
        now = (model / "config.json").read_bytes()
        if now != old_cfg and b'"quantization_config"' in now:
            break  # killed right after the switch, before the kept overlay was dropped
    assert (model / ".embedq" / "previous" / "journal.json").exists()
    new_qc = (model / "quantization_config.json").read_bytes()
    assert embedq("verify", model).returncode == 0
    r = embedq(*args[:-1])  # refused: the new overlay is there, complete
    assert r.returncode == 2 and "is back" not in r.stderr, r.stderr
    assert (model / "quantization_config.json").read_bytes() == new_qc
    assert not (model / ".embedq" / "previous").exists()


def test_requantize_in_place_interrupted_at_every_commit(bundle, tmp_path, fs):
    """Ctrl-C (an exception, as a full disk is) at each commit of ``quantize --force`` in
    place: exit 130 and the old overlay exactly, or the new one; nothing kept or staged."""
    model, reset, args, old, new = _requantize(bundle, tmp_path)
    _interrupt_each_commit(args, model, reset, old, new)


def test_requantize_without_hard_links_no_room_for_the_copy(bundle, tmp_path, monkeypatch):
    """No hard links, and the old overlay's copy does not fit (RLIMIT_FSIZE between the new
    and the old tables' sizes: EFBIG, as a full disk): refused before anything is switched,
    one line saying what to free; the old overlay exactly, nothing kept or staged."""
    model, reset, args, old, _ = _requantize(bundle, tmp_path)
    small = (model / "embedq.safetensors").stat().st_size  # the new 4-bit tables
    reset()
    big = (model / "embedq.safetensors").stat().st_size
    assert small < big
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(NO_LINKS), os.environ.get("PYTHONPATH")))))
    r = embedq(*args, fsize=(small + big) // 2)
    one_error_line(r, str(model), "no room to keep the current overlay", "embedq remove")
    assert settled(tree(model)) == settled(old) and not leftovers(model)
    assert embedq("verify", model).returncode == 0


def test_readers_refuse_a_folder_between_two_overlays(bundle, tmp_path):
    """Killed between the old overlay's switch-off and the new one's switch: config.json is
    the original model's, the tables the new ones. Every embedq reader refuses the folder with
    one line (it read the new tables with their settings before) until a locked run settles it."""
    import embedq as api
    from embedq.errors import OverlayError
    model, reset, args, old, _ = _requantize(bundle, tmp_path)
    reset()
    assert embedq(*args, kill_at="committed:3").returncode == -9
    before = tree(model)
    for verb in (("verify", model), ("inspect", model), ("onnx", "export", model, "-o", tmp_path / "x.onnx"),
                 ("push", model, "--repo-id", "org/m", "--dry-run")):
        one_error_line(embedq(*verb), "between two overlays", "previous/")
    with pytest.raises(OverlayError, match="between two overlays"):
        api.load(model)
    assert tree(model) == before  # read only
    lock = model / ".embedq" / "lock"  # a live run holding the lock is not "interrupted"
    lock.write_text(f"pid {os.getpid()}, embedq quantize\n")
    one_error_line(embedq("verify", model), "another embedq run is committing", f"pid {os.getpid()}")
    r = embedq("remove", model)  # locked: the old overlay back first, then removed
    assert r.returncode == 0 and "is back" in r.stderr, r.stderr


def test_apply_force_over_an_overlay_interrupted_at_every_commit(bundle, tmp_path):
    """``apply --force`` of a bundle over an in-place overlay of other settings, Ctrl-C at
    each commit: the old overlay exactly, or the new one; nothing kept or staged."""
    src, ov, _ = bundle
    first, model = tmp_path / "first", tmp_path / "model"
    _fresh(src, first)()
    assert embedq("quantize", first, "-q", "--lm-head", "--bits", "4").returncode == 0
    reset = _fresh(first, model)
    args = ("apply", model, "--overlay", ov, "--force")
    old, new = tree(first), _clean_run(reset, model, *args)
    _interrupt_each_commit(args, model, reset, old, new)


def test_requantize_in_place_full_disk_after_switch(bundle, tmp_path, monkeypatch):
    """A full disk when the new quantization_config.json is written (after the old overlay
    was switched off and the new tables renamed in): the old overlay is back, by renames."""
    import errno as _errno
    from embedq.errors import OverlayError
    from embedq.jobs import state
    from embedq.jobs.quantize import quantize_checkpoint
    from embedq.jobs.recipe import QuantizeRecipe
    model, reset, args, old, _ = _requantize(bundle, tmp_path)
    reset()
    real = state.write_json_atomic

    def full(path, obj):
        if path.name == "quantization_config.json":
            raise OverlayError(f"{path}: cannot write: {os.strerror(_errno.ENOSPC)}")
        return real(path, obj)
    monkeypatch.setattr(state, "write_json_atomic", full)
    from embedq.format.scheme import Scheme
    recipe = QuantizeRecipe(scheme=Scheme.default(4), lm_head=True, force=True, progress=False)
    with pytest.raises(OverlayError, match="No space left"):
        quantize_checkpoint(model, recipe)
    assert settled(tree(model)) == settled(old)


def test_card_killed(bundle, tmp_path):
    _, _, derived = bundle
    folder = tmp_path / "d"
    reset = _fresh(derived, folder)
    args = ("card", folder, "--base-model", "org/base-model")
    old = tree(derived)
    new = _clean_run(reset, folder, *args)
    assert new != old
    assert sweep(args, folder, reset, old, new) == 1


def test_ctrl_c_at_each_commit_of_apply(bundle, tmp_path):
    """Ctrl-C (SIGINT) at a commit: exit 130, one line, the old state or the new one, and
    nothing of the run's staging left behind (an exception cleans up; only a kill leaves any)."""
    src, ov, _ = bundle
    base = tmp_path / "base"
    reset = _fresh(src, base)
    new = _clean_run(reset, base, "apply", base, "--overlay", ov)
    for n in (1, 3):
        reset()
        r = embedq("apply", base, "--overlay", ov, kill_at=f"committed:{n}", sig="INT")
        assert r.returncode == 130, r.stderr
        assert "Traceback" not in r.stderr and "interrupted" in r.stderr.splitlines()[-1]
        assert loaded_view(tree(base)) in (loaded_view(tree(src)), loaded_view(new)), n
        assert not leftovers(base), n


@pytest.mark.parametrize("verb", ["apply", "quantize-output", "card", "remove"])
def test_full_disk(bundle, tmp_path, verb):
    """RLIMIT_FSIZE below the output's size: writes fail with EFBIG, as on a full disk."""
    src, ov, derived = bundle
    if verb == "remove":  # the restored config.json does not fit: the overlay stays, whole
        dest = tmp_path / "base"
        _fresh(src, dest)()
        assert embedq("apply", dest, "--overlay", ov).returncode == 0
        args, limit, needle = ("remove", dest), 256, "File too large"
    elif verb == "apply":
        dest = tmp_path / "base"
        _fresh(src, dest)()
        args, limit, needle = ("apply", dest, "--overlay", ov), 64 << 10, "File too large"
    elif verb == "quantize-output":
        dest = tmp_path / "out"
        args, limit, needle = ("quantize", src, "-q", "--lm-head", "--output", dest), 64 << 10, "File too large"
    else:
        dest = tmp_path / "d"
        _fresh(derived, dest)()
        args, limit, needle = ("card", dest, "--base-model", "org/base-model"), 1024, "File too large"
    old = tree(dest)
    r = embedq(*args, fsize=limit)
    one_error_line(r, needle, str(dest))
    assert tree(dest) == old  # not even a staged file
    assert not leftovers(tmp_path)
    assert embedq(*args).returncode == 0


@pytest.mark.parametrize("verb", ["apply", "quantize-output", "card", "remove"])
def test_read_only_destination(bundle, tmp_path, verb):
    src, ov, derived = bundle
    if verb in ("apply", "remove"):
        dest = tmp_path / "base"
        _fresh(src, dest)()
        if verb == "remove":
            assert embedq("apply", dest, "--overlay", ov).returncode == 0
        args, locked = (("apply", dest, "--overlay", ov) if verb == "apply" else ("remove", dest)), dest
    elif verb == "quantize-output":
        parent = tmp_path / "ro"
        parent.mkdir()
        dest = parent / "out"
        args, locked = ("quantize", src, "-q", "--output", dest), parent
    else:
        dest = tmp_path / "d"
        _fresh(derived, dest)()
        args, locked = ("card", dest, "--base-model", "org/base-model"), dest
    old = tree(dest)
    with read_only(locked):
        r = embedq(*args)
    one_error_line(r, str(locked))
    assert tree(dest) == old
    assert embedq(*args).returncode == 0


@pytest.mark.parametrize("garbage", ["config", "weights", "none"])
def test_apply_garbage_overlay(bundle, tmp_path, garbage):
    src, ov, _ = bundle
    bad, base = tmp_path / "bad", tmp_path / "base"
    shutil.copytree(ov, bad)
    if garbage == "config":
        (bad / "quantization_config.json").write_bytes(b"\x00{not json")
    elif garbage == "weights":
        (bad / "embedq.safetensors").write_bytes(b"\xff" * 64)
    else:
        shutil.rmtree(bad)
        bad.mkdir()
    _fresh(src, base)()
    r = embedq("apply", base, "--overlay", bad)
    one_error_line(r, str(bad))
    assert tree(base) == tree(src)


def test_verify_removes_a_killed_runs_leftovers(bundle, tmp_path):
    src, ov, _ = bundle
    base = tmp_path / "base"
    _fresh(src, base)()
    assert embedq("apply", base, "--overlay", ov, kill_at="staged:1").returncode == -9
    assert leftovers(base)
    r = embedq("verify", base)
    assert "leftover(s) of an interrupted run" in r.stderr and not leftovers(base), r.stderr
