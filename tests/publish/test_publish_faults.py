"""push's local writes under a kill (the other verbs: tests/test_faults.py)."""

from __future__ import annotations

import shutil

from faultutil import embedq, tree, without_leftovers
from pubutil import derive, hub_env  # noqa: F401 (fixture)


def _fresh(src, dst):
    def reset():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True)
    return reset


def test_push_killed_while_updating_the_local_card(derive, tmp_path):
    """push's one local write (README.md after the commit) is staged: a kill leaves the
    old card, a rerun the new one, nothing else."""
    from fakehub import FakeHub
    _, derived, _ = derive("llama_untied_sharded", lm_head=True)
    folder = tmp_path / "d"
    reset = _fresh(derived, folder)
    with FakeHub() as hub:
        env = hub_env(hub, tmp_path)
        args = ("push", folder, "--repo-id", "me/tiny", "--json")
        reset()
        old = tree(folder)
        r = embedq(*args, env=env)
        assert r.returncode == 0, r.stderr
        new = tree(folder)
        reset()
        r = embedq(*args, env=env, kill_at="staged:1")
        assert r.returncode == -9, r.stderr
        assert without_leftovers(tree(folder)) in (old, new)
        r = embedq(*args, env=env)
        assert r.returncode == 0, r.stderr
        assert tree(folder) == new
