"""``embedq push``: upload a derived checkpoint or an overlay bundle to the Hugging Face Hub.

Only what a model repository needs is uploaded (:data:`ALLOWED`: weights, configs,
tokenizer, card, overlay; more with ``include`` / ``--include``): no ``.embedq/``
backups, no ``*.partial`` temporary files, no dotfiles or dot-folders
(``.cache/huggingface`` download records, ``.git``), no tokens or logs, nothing under a
symlinked folder, no linked file that leads out of the folder (docs/security.md). The folder is checked first (overlay
config valid, overlay tensors match their checksums, every shard the index names is
present, the card's front matter valid), so a broken folder fails before any network
call. Then: ``create_repo`` (exist_ok), ``create_branch`` for a non-default
``revision``, the large files are pre-uploaded, and one commit is created. The
token comes from ``token``, else the usual huggingface_hub places (``HF_TOKEN``,
``hf auth login``); the endpoint from ``HF_ENDPOINT``.

An embedq-generated ``README.md`` is re-rendered for the target repository (its load
instructions name the repo; eval results found in ``embedq-eval.json`` are added); the
new text is what gets uploaded, and it replaces the local README.md only after the
commit succeeded. Pass ``update_card=False`` to upload the card as it is.
A failure (network, permission, server) raises :class:`PublishError` with one line
saying in which step it failed; the local folder is never modified by a failure.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from embedq.errors import EmbedqError
from embedq.format.constants import QUANT_METHOD
from embedq.format.digest import new_hasher

_REPO_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
TEMP_SUFFIXES = (".partial", ".incomplete", ".lock", ".tmp")


class PublishError(EmbedqError):
    """Uploading to the Hub failed (network, permissions, server)."""

    exit_code = 3


@dataclass
class PushResult:
    """What :func:`push` did (or, with ``dry_run``, would do)."""

    folder: str
    repo_id: str
    revision: str | None
    private: bool
    files: list[tuple[str, int]]  # (path in repo, bytes), in upload order
    skipped: list[str] = field(default_factory=list)
    dry_run: bool = False
    commit_url: str | None = None
    repo_url: str | None = None
    card_updated: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)

    def operations(self) -> list[str]:
        ops = [f"create repo {self.repo_id} ({'private' if self.private else 'public'}; "
               "kept as is if it exists)"]
        if self.revision and self.revision != "main":
            ops.append(f"create branch {self.revision} (if missing)")
        ops += [f"upload {p} ({s:,} bytes)" for p, s in self.files]
        ops.append(f"commit {len(self.files)} files, {self.total_bytes:,} bytes, to "
                   f"{self.repo_id}@{self.revision or 'main'}")
        return ops

    def to_dict(self) -> dict:
        d = asdict(self)
        d["files"] = [{"path": p, "size": s} for p, s in self.files]
        d["total_bytes"] = self.total_bytes
        d["operations"] = self.operations()
        return d

    def __str__(self) -> str:
        lines = []
        if self.dry_run:
            lines.append("dry run: nothing was sent")
        if self.card_updated:
            lines.append("README.md: model card " + ("would be " if self.dry_run else "")
                         + f"re-rendered for {self.repo_id}")
        width = max((len(p) for p, _ in self.files), default=0)
        for op in self.operations():
            if op.startswith("upload "):
                p, s = next((p, s) for p, s in self.files if op == f"upload {p} ({s:,} bytes)")
                lines.append(f"  upload {p.ljust(width)}  {_human(s):>10}")
            else:
                lines.append(op)
        for s in self.skipped:
            lines.append(f"  skip   {s}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        if self.commit_url:
            lines.append(self.commit_url)
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------ folder checks

# What a model repository needs; anything else is left out unless ``include`` names it.
ALLOWED = (
    "*.safetensors", "*.safetensors.index.json",                       # weights + index
    "config.json", "generation_config.json", "quantization_config.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "sentencepiece.bpe.model", "*.tiktoken", "chat_template.json", "chat_template.jinja",
    "README.md", "LICENSE", "LICENSE.*", "LICENSE-*", "NOTICE", "NOTICE.*", "USE_POLICY.md",
    "embedq-eval.json",                                                # card inputs
    "*.onnx", "*.onnx_data", "*.onnx.data", "onnx/*",                  # embedq onnx patch
)


def _wanted(rel: str, include: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(rel, pat) for pat in ALLOWED + include)


def select_files(folder: str | os.PathLike, include: list[str] | tuple[str, ...] = ()
                 ) -> tuple[list[tuple[str, int]], list[str]]:
    """Files of ``folder`` to upload (POSIX relative path, size) and what is left out.

    Only what a model repository needs (:data:`ALLOWED`: weights, configs, tokenizer,
    card, overlay) plus the glob patterns in ``include``; never a dotfile, a temporary
    file, or a link that leads out of the folder (a Hugging Face cache snapshot's links
    into its own ``blobs/`` are fine).
    """
    from embedq.format.files import stays_inside
    root = Path(folder)
    include = tuple(include or ())
    files: list[tuple[str, int]] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        rel_dir = d.relative_to(root)
        keep = []
        for name in sorted(dirnames):
            rel = (rel_dir / name).as_posix()
            if name.startswith(".") or name == "__pycache__":
                skipped.append(rel + "/")
            elif (d / name).is_symlink():
                skipped.append(rel + "/ (symlinked folder)")
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if name.startswith(".") or name.endswith(TEMP_SUFFIXES):
                skipped.append(rel)
                continue
            p = d / name
            if not _wanted(rel, include):
                skipped.append(rel + " (not part of a model repository; --include to upload it)")
                continue
            if p.is_symlink() and not stays_inside(root, p):
                skipped.append(rel + " (a link out of the folder)")
                continue
            try:
                st = p.stat()  # follows a link inside the folder (or to a HF cache blob)
            except OSError:
                skipped.append(rel + " (broken link)")
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped.append(rel + " (not a regular file)")
                continue
            files.append((rel, st.st_size))
    files.sort(key=lambda x: (x[0] != "README.md", x[0]))
    return files, sorted(skipped)


def check_folder(folder: Path, files: list[tuple[str, int]]) -> list[str]:
    """Refuse a folder that is not a complete embedq checkpoint or bundle; return warnings."""
    from embedq.format.checkpoint import CONFIG_NAME, INDEX_NAME, check_config, index_weight_map, read_json
    from embedq.format.kept import check_settled
    from embedq.format.reader import check_overlay_header, parse_overlay_config
    if not folder.is_dir():
        raise EmbedqError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    names = {p for p, _ in files}
    check_settled(folder)  # between two overlays: its own line, not "not an embedq checkpoint"
    try:
        qconfig = parse_overlay_config(folder)
    except EmbedqError as e:
        raise EmbedqError(f"{folder}: not an embedq checkpoint or overlay bundle ({e})") from None
    ovname = qconfig.overlay
    ovfile = folder / ovname
    if ovname not in names:
        raise EmbedqError(f"{ovfile}: overlay file missing; nothing to publish")
    # The overlay is small next to the model: check every recorded checksum now rather than
    # publish a corrupt table, and its header as every reader does (an undeclared tensor,
    # e.g. a float lm_head.weight vLLM's loader would take, is never published)
    n, header = check_overlay_header(ovfile, qconfig)
    expected = {}
    for entry in qconfig.modules.values():
        entry.require_checksums(qconfig.where, "re-create the overlay before publishing")
        expected.update(entry.checksums)
    with open(ovfile, "rb") as f:
        for k, want in expected.items():
            if k not in header:
                raise EmbedqError(f"{ovfile}: missing tensor {k}")
            b, e = header[k]["data_offsets"]
            h = new_hasher(qconfig.digest)
            for off in range(0, e - b, 64 << 20):
                h.update(os.pread(f.fileno(), min(64 << 20, e - b - off), 8 + n + b + off))
            if h.hexdigest() != want:
                raise EmbedqError(f"{ovfile}: tensor {k} does not match its recorded checksum; "
                                  "re-create the overlay before publishing")
    warnings = []
    if INDEX_NAME in names:
        index = read_json(folder / INDEX_NAME)
        missing = sorted(set(index_weight_map(index, str(folder / INDEX_NAME), folder).values()) - names)
        if missing:
            raise EmbedqError(f"{folder / INDEX_NAME}: names {', '.join(missing)}, not in the folder")
    if CONFIG_NAME in names:
        qc = check_config(read_json(folder / CONFIG_NAME), str(folder / CONFIG_NAME)).get(
            "quantization_config") or {}
        if qc.get("quant_method") != QUANT_METHOD:
            warnings.append(f"{CONFIG_NAME} has no embedq quantization_config; loaders will "
                            "not see the overlay")
    if "README.md" in names:
        from embedq.jobs.card import CardError, validate_metadata
        try:
            from huggingface_hub import ModelCard
            meta = ModelCard((folder / "README.md").read_text(encoding="utf-8")).data.to_dict()
        except Exception as e:
            raise EmbedqError(f"{folder / 'README.md'}: front matter is not valid YAML ({e})".split("\n")[0]) from None
        try:
            validate_metadata(meta, str(folder / "README.md"))
        except CardError:
            raise
        except Exception as e:  # ModelCardData rejecting a field
            raise EmbedqError(f"{folder / 'README.md'}: invalid front matter ({e})".split("\n")[0]) from None
    else:
        warnings.append("no README.md model card (embedq quantize --output writes one)")
    return warnings


# -------------------------------------------------------------------------- push

def _reason(e: BaseException) -> str:
    """One line naming the error and its root cause."""
    parts, seen, x = [], set(), e
    while x is not None and id(x) not in seen and len(parts) < 3:
        seen.add(id(x))
        resp = getattr(x, "response", None)
        status = getattr(resp, "status_code", None)
        first = next((ln.strip() for ln in str(x).splitlines() if ln.strip()), "")
        label = type(x).__name__ + (f" (HTTP {status})" if status else "")
        part = f"{label}: {first}" if first else label
        if not parts or parts[-1] != part:
            parts.append(part)
        x = x.__cause__ or x.__context__
    msg = " <- ".join(parts)
    return msg if len(msg) <= 400 else msg[:397] + "..."


def _check_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise EmbedqError(f"--repo-id {repo_id!r}: not a Hub repository id (expected user/name)")
    return repo_id


def _commit_message(folder: Path) -> str:
    try:
        from embedq.format.reader import parse_overlay_config
        q = parse_overlay_config(folder)
        schemes = sorted({e.scheme.label() for e in q.modules.values()})
        kind = "overlay bundle" if not (folder / "config.json").exists() else "checkpoint"
        return f"Upload embedq {kind} ({', '.join(schemes)})"
    except Exception:
        return "Upload embedq checkpoint"


def push(folder: str | os.PathLike, repo_id: str, private: bool = False, revision: str | None = None,
         dry_run: bool = False, token: str | None = None, *, commit_message: str | None = None,
         update_card: bool = True, progress: bool = True, include: list[str] | None = None) -> PushResult:
    """Upload ``folder`` to the Hub repository ``repo_id`` in one commit.

    Returns a :class:`PushResult`; ``result.commit_url`` is the commit's URL (None for
    a dry run, which lists the operations and sizes and contacts nothing).
    Raises :class:`PublishError` (one line, exit code 3 in the CLI) when the Hub
    cannot be reached or refuses, and :class:`~embedq.errors.EmbedqError` when the
    folder is not fit to publish.
    """
    folder = Path(folder)
    _check_repo_id(repo_id)
    if revision is not None and (not revision or any(c.isspace() for c in revision)):
        raise EmbedqError(f"--revision {revision!r}: not a branch name")
    if not dry_run:  # a killed push's staged card (its one local write) goes first
        from embedq.format.staging import clean_leftovers
        clean_leftovers(folder, ["README.md"])
    files, skipped = select_files(folder, tuple(include or ())) if folder.is_dir() else ([], [])
    warnings = check_folder(folder, files)
    if dry_run and not private:
        warnings.append(f"a new repository {repo_id} would be public; pass --private to create it private")
    if any(s.endswith(TEMP_SUFFIXES) for s in skipped):
        warnings.append("temporary files of an interrupted run are left out")

    card_text, card_updated = None, False
    # only a selected README.md: a link out of the folder is skipped, never read nor replaced
    if update_card and "README.md" in {p for p, _ in files}:
        from embedq.jobs.card import read_stored, refresh_card
        old = (folder / "README.md").read_text(encoding="utf-8")
        if read_stored(old) is not None:
            card_text = refresh_card(folder, repo_id=repo_id if "/" in repo_id else None, write=False)
            card_updated = card_text != old
            if card_updated:
                files = [(p, len(card_text.encode("utf-8")) if p == "README.md" else s) for p, s in files]

    result = PushResult(str(folder), repo_id, revision, private, files, skipped, dry_run,
                        card_updated=card_updated, warnings=warnings)
    if dry_run:
        return result

    import huggingface_hub as hf
    from huggingface_hub import CommitOperationAdd, HfApi
    tok = token or hf.get_token()
    if not tok:
        raise PublishError("no Hugging Face token: run `hf auth login`, set HF_TOKEN, or pass --token")

    api = HfApi(token=tok)
    done_nothing = "nothing was committed; the local folder is unchanged"
    step = "creating the repository"
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        result.repo_url = str(url)
        target = getattr(url, "repo_id", None) or repo_id
        if revision and revision != "main":
            step = f"creating branch {revision}"
            api.create_branch(target, branch=revision, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=card_text.encode("utf-8")
                                  if card_updated and p == "README.md" else str(folder / p))
               for p, _ in files]
        step = "uploading files"
        with _maybe_quiet(progress):
            api.preupload_lfs_files(target, additions=ops, revision=revision, free_memory=False)
            step = "creating the commit"
            info = api.create_commit(target, operations=ops, revision=revision,
                                     commit_message=commit_message or _commit_message(folder))
    except KeyboardInterrupt:
        raise
    except Exception as e:
        after = done_nothing if step != "creating the commit" else \
            "the commit may not have been created; the local folder is unchanged"
        raise PublishError(f"push to {repo_id} failed while {step}: {_reason(e)}; {after}") from e
    result.commit_url = str(info.commit_url)
    if card_updated:  # keep the folder equal to what was published
        from embedq.format.files import write_bytes_atomic
        write_bytes_atomic(folder / "README.md", card_text.encode("utf-8"))
    return result


class _maybe_quiet:
    """Disable huggingface_hub progress bars when ``progress`` is False."""

    def __init__(self, progress: bool):
        self.progress = progress
        self._was = None

    def __enter__(self):
        if not self.progress:
            from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
            self._was = are_progress_bars_disabled()
            disable_progress_bars()
        return self

    def __exit__(self, *exc):
        if not self.progress and not self._was:
            from huggingface_hub.utils import enable_progress_bars
            enable_progress_bars()
        return False


__all__ = ["push", "PushResult", "PublishError", "select_files", "check_folder"]
