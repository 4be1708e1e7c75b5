"""``embedq push`` against a local fake Hub (HF_ENDPOINT) and in dry-run mode."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.errors import EmbedqError
from embedq.hub.push import PublishError, push, select_files

from fakehub import FakeHub
from pubutil import derive, fake_hub, hub_env, snapshot  # noqa: F401 (fixtures)


def _clutter(folder):
    """Things an upload must leave out."""
    (folder / ".embedq").mkdir(exist_ok=True)
    (folder / ".embedq" / "config.json").write_text("{}")
    (folder / ".embedq-probe-1").write_bytes(b"")
    (folder / ".model.safetensors.123.partial").write_bytes(b"x" * 10)
    (folder / "leftover.incomplete").write_bytes(b"y")
    (folder / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("z")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")


def _expected(folder, names):
    return sorted((n, (folder / n).stat().st_size) for n in names)


def test_dry_run_lists_exactly_the_files(derive):
    _, out, _ = derive("llama_untied_sharded", base_model="meta-llama/Llama-3.2-1B")
    _clutter(out)
    # A dry run contacts nothing: an endpoint that does not exist must not matter.
    with FakeHub() as hub:
        r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/llama-int8", "--dry-run",
                                     "--json"], env={"HF_ENDPOINT": hub.url, "HF_TOKEN": ""})
        assert r.exit_code == 0, r.output
        assert hub.log == []
    res = json.loads(r.stdout)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    want = ["README.md", "config.json", "embedq.safetensors", "generation_config.json",
            "model.safetensors.index.json", "quantization_config.json"] + shards
    got = {f["path"]: f["size"] for f in res["files"]}
    assert sorted(got) == sorted(want)
    card = push(out, "me/llama-int8", dry_run=True)  # same through the Python API
    readme = [s for p, s in card.files if p == "README.md"][0]
    for p, s in got.items():  # the card is re-rendered for the repo; the rest as on disk
        assert s == (readme if p == "README.md" else (out / p).stat().st_size), p
    assert res["total_bytes"] == sum(got.values())
    assert res["commit_url"] is None and res["dry_run"] is True
    assert any(s.startswith(".embedq") for s in res["skipped"])
    assert ".model.safetensors.123.partial" in res["skipped"] and "leftover.incomplete" in res["skipped"]
    ops = res["operations"]
    assert ops[0].startswith("create repo me/llama-int8 (public")
    assert ops[-1].startswith(f"commit {len(want)} files")
    assert (out / "README.md").read_text().count("me/llama-int8") == 0  # dry run wrote nothing


def test_select_files_what_a_model_repository_needs_and_never_more(tmp_path):
    """docs/security.md 10: weights + index, configs, tokenizer files, card, licence, overlay
    and ONNX files go; anything else only through --include; dotfiles, temporary files, a
    symlinked folder and a link out of the folder never, whatever --include says."""
    f = tmp_path / "m"
    (f / "onnx").mkdir(parents=True)
    wanted = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
              "generation_config.json", "quantization_config.json", "embedq.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "README.md", "LICENSE", "model.onnx",
              "model.onnx_data", "onnx/decoder.onnx"]
    other = ["notes.txt", "train.py", "optimizer.pt"]
    never = [".gitattributes", ".env", "model.safetensors.tmp", "x.safetensors.partial",
             "pytorch_model.bin.incomplete", "config.json.lock", ".cache/huggingface/x.json"]
    for n in wanted + other + never:
        (f / n).parent.mkdir(parents=True, exist_ok=True)
        (f / n).write_text(n)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.json").write_text("token")
    (f / "vocab.json").symlink_to(secret / "key.json")  # an allowed name leading out
    (f / "linked").symlink_to(secret, target_is_directory=True)
    files, skipped = select_files(f)
    assert sorted(p for p, _ in files) == sorted(wanted)
    assert "vocab.json (a link out of the folder)" in skipped and "linked/ (symlinked folder)" in skipped
    files, skipped = select_files(f, include=["*", ".*", "*/*", "**"])
    assert sorted(p for p, _ in files) == sorted(wanted + other)
    for n in never:
        assert not any(p == n or p.startswith(n.split("/")[0] + "/") for p, _ in files), n
    assert "vocab.json (a link out of the folder)" in skipped and "linked/ (symlinked folder)" in skipped


def test_dry_run_overlay_bundle_and_text(derive):
    _, out, _ = derive("qwen2_tied", bits=4, overlay_only=True, base_model="Qwen/Qwen2-0.5B",
                       base_revision="d" * 40)
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/qwen-q4-overlay", "--dry-run",
                                 "--private", "--revision", "v1"])
    assert r.exit_code == 0, r.output
    assert "dry run: nothing was sent" in r.output
    assert "create repo me/qwen-q4-overlay (private" in r.output
    assert "create branch v1" in r.output
    files = [ln.split()[1] for ln in r.output.splitlines() if ln.strip().startswith("upload ")]
    assert files == ["README.md", "embedq.safetensors", "quantization_config.json"]


def test_push_sends_the_expected_commit(derive, tmp_path):
    """The CLI in a subprocess, with HF_ENDPOINT pointing at the fake Hub."""
    _, out, _ = derive("llama_untied_sharded", lm_head=True, group_size=0, base_model="meta-llama/Llama-3.2-1B")
    _clutter(out)
    with FakeHub() as hub:
        r = subprocess.run([sys.executable, "-m", "embedq.cli", "push", str(out), "--repo-id",
                            "me/llama-int8", "--private"], env=hub_env(hub, tmp_path),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        commits = hub.commits("me/llama-int8")
        assert len(commits) == 1
        c = commits[0]
        url = r.stdout.strip().splitlines()[-1]
        assert url == f"{hub.url}/me/llama-int8/commit/{c['oid']}"
        assert hub.repos["me/llama-int8"]["visibility"] == "private"
        assert c["branch"] == "main"
        assert c["header"]["summary"] == "Upload embedq checkpoint (int8 row sym)"
        files = c["files"]
        want = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")
                      and not p.name.endswith(".incomplete"))
        assert sorted(files) == want
        for name, f in files.items():
            data = (out / name).read_bytes()
            assert f["size"] == len(data), name
            assert f["sha256"] == hashlib.sha256(data).hexdigest(), name
            assert f["lfs"] == name.endswith(".safetensors"), name
        # The published card names the repository, and the local README now equals it.
        card = ModelCard(files["README.md"]["content"].decode())
        assert card.data.base_model == "meta-llama/Llama-3.2-1B"
        assert 'hf download me/llama-int8 --local-dir ./llama-int8' in card.text
        methods = [m for m, _ in hub.log]
        assert ("POST", "/api/repos/create") in hub.log
        assert methods.count("PUT") == sum(1 for n in files if n.endswith(".safetensors"))


def test_push_python_api_revision_and_repush(derive, fake_hub):
    _, out, _ = derive("qwen2_tied", bits=4, overlay_only=True, base_model="Qwen/Qwen2-0.5B")
    res = embedq.push(out, "me/qwen-overlay", revision="q4", progress=False)
    assert res.commit_url.startswith(f"{fake_hub.url}/me/qwen-overlay/commit/")
    assert "q4" in fake_hub.repos["me/qwen-overlay"]["branches"]
    c = fake_hub.commits("me/qwen-overlay")[0]
    assert c["branch"] == "q4" and sorted(c["files"]) == ["README.md", "embedq.safetensors",
                                                          "quantization_config.json"]
    assert c["header"]["summary"] == "Upload embedq overlay bundle (int4 g32 sym)"
    # Pushing again reuses the repository, branch and already-uploaded LFS objects.
    puts = [m for m, _ in fake_hub.log].count("PUT")
    res2 = embedq.push(out, "me/qwen-overlay", revision="q4", progress=False)
    assert res2.commit_url != res.commit_url and len(fake_hub.commits("me/qwen-overlay")) == 2
    assert [m for m, _ in fake_hub.log].count("PUT") == puts


def test_network_failure_mid_upload(derive, fake_hub, tmp_path):
    _, out, _ = derive("llama_untied_sharded", base_model="meta-llama/Llama-3.2-1B")
    before = snapshot(out)
    fake_hub.fail_upload = True
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/llama-int8"])
    assert r.exit_code == 3
    err = r.stderr.strip().splitlines()[-1]  # (huggingface_hub's progress bars come before)
    assert err.count("embedq: error") == 1 and r.stderr.count("embedq: error") == 1
    assert err.startswith("embedq: error: push to me/llama-int8 failed while uploading files: ")
    assert "nothing was committed; the local folder is unchanged" in err
    assert fake_hub.put_attempts >= 2  # huggingface_hub retried, then gave up
    assert fake_hub.commits("me/llama-int8") == []
    assert snapshot(out) == before  # README not re-rendered, nothing added or removed
    # Python API: a PublishError, which is an EmbedqError.
    with pytest.raises(PublishError, match="failed while uploading files"):
        push(out, "me/llama-int8", progress=False)
    assert issubclass(PublishError, EmbedqError)
    # Once the network is back, the same command succeeds.
    fake_hub.fail_upload = False
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/llama-int8"])
    assert r.exit_code == 0, r.output
    assert len(fake_hub.commits("me/llama-int8")) == 1


def test_auth_errors_are_one_line(derive, fake_hub, monkeypatch, tmp_path):
    _, out, _ = derive("qwen2_tied")
    before = snapshot(out)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/q"])
    assert r.exit_code == 3
    assert r.stderr.count("\n") == 1, r.stderr
    assert "failed while creating the repository" in r.stderr and "401" in r.stderr
    monkeypatch.delenv("HF_TOKEN")
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/q"])
    assert r.exit_code == 3 and "no Hugging Face token" in r.stderr
    assert snapshot(out) == before


def test_refuses_unfit_folders(derive, model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    with pytest.raises(EmbedqError, match="not an embedq checkpoint or overlay bundle"):
        push(src, "me/x", dry_run=True)
    _, out, _ = derive("qwen2_tied")
    f = out / "embedq.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(EmbedqError, match="does not match its recorded checksum"):
        push(out, "me/x", dry_run=True)
    _, out2, _ = derive("llama_untied_sharded", name="out2")
    next(out2.glob("model-*.safetensors")).unlink()
    with pytest.raises(EmbedqError, match="names .*not in the folder"):
        push(out2, "me/x", dry_run=True)
    with pytest.raises(EmbedqError, match="not a Hub repository id"):
        push(out2, "me/x/y", dry_run=True)


def test_in_place_overlay_pushes_without_backups(model_factory, fake_hub):
    src = model_factory("qwen2_tied")
    embedq.quantize(src, 8, progress=False)
    assert (src / ".embedq").is_dir()
    files, skipped = select_files(src)
    assert ".embedq/" in skipped and not any(p.startswith(".embedq") for p, _ in files)
    res = push(src, "me/in-place", progress=False)
    c = fake_hub.commits("me/in-place")[0]
    assert sorted(c["files"]) == sorted(p for p, _ in res.files)
    assert "embedq.safetensors" in c["files"] and "model.safetensors" in c["files"]


def test_readme_link_out_of_the_folder_is_never_read_nor_replaced(derive, fake_hub, tmp_path):
    _, out, _ = derive("qwen2_tied", bits=4, overlay_only=True)
    outside = tmp_path / "outside_card.md"
    outside.write_text((out / "README.md").read_text())  # an embedq card: it would be re-rendered
    (out / "README.md").unlink()
    (out / "README.md").symlink_to("../outside_card.md")
    card_before = outside.read_bytes()
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/x", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "README.md (a link out of the folder)" in r.output and "re-rendered" not in r.output
    res = push(out, "me/x", progress=False)
    assert not res.card_updated and "README.md" not in fake_hub.commits("me/x")[0]["files"]
    assert (out / "README.md").is_symlink() and outside.read_bytes() == card_before


def test_config_quantization_config_not_an_object(derive):
    _, out, _ = derive("qwen2_tied", bits=8)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = "x"
    (out / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["push", str(out), "--repo-id", "me/x", "--dry-run"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == f'embedq: error: {out / "config.json"}: quantization_config is "x", expected an object'


def test_refuses_a_bundle_without_a_checksum(derive):
    """push checks every overlay tensor before uploading: a config whose checksum for one
    tensor was dropped would publish that tensor unchecked."""
    _, bundle, _ = derive("qwen2_tied", overlay_only=True)
    qfile = bundle / "quantization_config.json"
    qc = json.loads(qfile.read_text())
    mod = next(iter(qc["modules"].values()))
    mod["checksums"].pop(next(iter(mod["checksums"])))
    qfile.write_text(json.dumps(qc))
    with pytest.raises(EmbedqError, match="no checksum recorded for .*re-create the overlay before publishing"):
        push(bundle, "me/x", dry_run=True)


def test_refuses_an_overlay_with_an_undeclared_tensor(derive):
    """push holds the overlay file's header to the config as every reader does: a tensor the
    config does not declare (a float lm_head.weight, which vLLM's weight loader would take for
    the head) is refused before anything is published, with the checksums all matching."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    _, bundle, _ = derive("qwen2_tied", overlay_only=True)
    f = bundle / "embedq.safetensors"
    with safe_open(str(f), "pt") as st:
        tensors, meta = {k: st.get_tensor(k) for k in st.keys()}, st.metadata()
    first = next(iter(tensors.values()))
    save_file({**tensors, "lm_head.weight": first.float()}, str(f), metadata=meta)
    before = snapshot(bundle)
    r = CliRunner().invoke(app, ["push", str(bundle), "--repo-id", "me/x", "--dry-run"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "'lm_head.weight', which the config does not declare" in lines[0], r.output
    assert snapshot(bundle) == before

