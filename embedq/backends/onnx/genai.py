"""onnxruntime-genai folders: a ``genai_config.json`` beside the decoder model.

:func:`~embedq.backends.onnx.patch.patch_model` patches the decoder into a new folder
that onnxruntime_genai opens as is; this module reads and checks the folder, names the
files the patch rewrites, and copies the rest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from embedq.backends.onnx.common import (OnnxError, check_external_data, external_data, iter_tensors,
                                         tensor_proto)
from embedq.format.files import check_links, inside, name_problem

GENAI_CONFIG = "genai_config.json"


def is_genai_folder(path: Path) -> bool:
    return path.is_dir() and (path / GENAI_CONFIG).is_file()


def genai_provider(gcfg: dict) -> str:
    """The execution provider a genai_config.json asks for (cpu when it names none)."""
    opts = ((gcfg.get("model") or {}).get("decoder") or {}).get("session_options", {}).get("provider_options") or []
    for o in opts:
        for k in (o or {}):
            return k.lower()
    return "cpu"


@dataclass
class GenaiFolder:
    """A checked genai folder and where its patched copy goes."""
    src: Path
    out: Path
    config: dict  # genai_config.json
    decoder: str  # model.decoder.filename, relative to src (and to out)
    model: Path  # src / decoder, checked to stay inside src
    in_place: bool  # out is src


def open_genai_folder(src: Path, out: Path, force: bool, overlay: Path | None = None) -> GenaiFolder:
    """Read ``src``'s config and refuse, before anything is written, what cannot be patched.

    OUT is written whole and put in place at once, so it must not be, hold or lie inside
    the source or the overlay; ``force`` replaces only an earlier output of this command
    (:func:`is_genai_output`) or an empty folder, never another folder.
    """
    # Everything of the folder is read or copied into the output: no link may lead out.
    check_links(src)
    try:
        gcfg = json.loads(inside(src, GENAI_CONFIG).read_text())
        fname = gcfg["model"]["decoder"]["filename"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise OnnxError(f"{src / GENAI_CONFIG}: no model.decoder.filename ({e})") from None
    if name_problem(fname) or not (src / fname).is_file():
        raise OnnxError(f"{src / GENAI_CONFIG}: decoder {str(fname)[:200]!r} is not a model file in {src}")
    model = inside(src, fname, named_by=f"{src / GENAI_CONFIG}: decoder")
    in_place = out.exists() and out.resolve() == src.resolve()
    if in_place and not force:
        raise OnnxError(f"{out}: is the input folder; pass --force to patch it in place")
    # a new OUT is replaced whole, so it may not be, hold or lie in an input; in place only
    # the decoder and its data are rewritten (patch_model refuses an overlay file among them)
    if not in_place:
        _check_apart(out, [("the input folder", src)] + ([("the overlay", overlay)] if overlay is not None else []))
    if out.exists() and not in_place:
        if not out.is_dir():
            raise OnnxError(f"{out}: not a folder (a genai folder is written as a folder)")
        if any(out.iterdir()):
            if not force:
                raise OnnxError(f"{out}: already exists and is not empty (pass --force to replace it)")
            if not is_genai_output(out):
                raise OnnxError(f"{out}: not empty and not a genai folder embedq patched (its {GENAI_CONFIG} "
                                "names no decoder with embedq metadata); --force replaces only those: "
                                "choose a new or empty folder")
    return GenaiFolder(src, out, gcfg, fname, model, in_place)


def _check_apart(out: Path, inputs: list[tuple[str, Path]]) -> None:
    """Refuse an OUT that is, holds, or lies inside an input folder: replacing OUT whole
    would delete it, or the copy would read its own output."""
    o = out.resolve()
    for what, p in inputs:
        r = Path(p).resolve()
        if o == r or o in r.parents or r in o.parents:
            rel = "is" if o == r else "holds" if o in r.parents else "is inside"
            raise OnnxError(f"{out}: {rel} {what} {p}; write the patched folder elsewhere")


def is_genai_output(folder: Path) -> bool:
    """Whether ``folder`` is a genai folder this command wrote: its ``genai_config.json``
    names a decoder file whose metadata has ``embedq.version`` (what every patch records)."""
    from embedq.backends.onnx.common import META_PREFIX
    try:
        fname = json.loads((folder / GENAI_CONFIG).read_text())["model"]["decoder"]["filename"]
        model = folder / fname
        if name_problem(fname) or model.is_symlink() or not model.is_file():
            return False
        import onnx
        mp = onnx.load(str(model), load_external_data=False)
    except Exception:  # unreadable, foreign or damaged: not ours
        return False
    return any(p.key == META_PREFIX + "version" for p in mp.metadata_props)


def model_files(folder: GenaiFolder, mp) -> set[Path]:
    """The decoder and its external data files (resolved): the patch rewrites these, so
    they are not copied. ``mp`` is the decoder, loaded without its external data."""
    src, model = folder.src, folder.model
    check_external_data(mp, src, model)
    return {model.resolve()} | {external_data(t, src, model)[0] for t in iter_tensors(mp)
                                if t.data_location == tensor_proto().EXTERNAL}


def copy_rest(folder: GenaiFolder, own: set[Path]) -> None:
    """Copy everything else (genai_config.json, tokenizer, chat template, processor
    configs) as is; hidden files stay behind."""
    src, out = folder.src, folder.out
    for p in sorted(src.iterdir()):
        if p.resolve() in own or p.name.startswith("."):
            continue
        dst = out / p.name
        if p.is_dir():
            shutil.copytree(p, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(p, dst)


def write_folder(folder: GenaiFolder, own: set[Path], patch_decoder):
    """Write the patched folder; ``patch_decoder(path)`` patches the decoder to ``path``.

    In place, the decoder's own commit applies (data generations, the model renamed last).
    Otherwise the whole folder is staged beside OUT (``.<name>.embedq-partial-*``),
    fsynced, and put in OUT's place at once (:func:`embedq.format.staging.exchange`): a
    kill leaves no half folder, only staging the next run removes.
    """
    from embedq.format import staging
    from embedq.backends.onnx.write import new_parents
    out = folder.out
    if folder.in_place:
        return patch_decoder(out / folder.decoder)
    with new_parents(out):
        staging.clean_leftovers(out.parent, [out.name])
        return _stage_folder(folder, own, patch_decoder, staging.partial_path(out))


def _stage_folder(folder: GenaiFolder, own: set[Path], patch_decoder, stage: Path):
    from dataclasses import replace
    from embedq.format import staging
    out = folder.out
    try:
        stage.mkdir()
        report = patch_decoder(stage / folder.decoder)
        copy_rest(replace(folder, out=stage), own)
        for f in stage.rglob("*"):
            if f.is_file():
                staging.fsync_file(f)
        staging.kill_point("staged")
        staging.exchange(stage, out)
    except BaseException as e:
        staging.remove(stage)
        err = staging.renamed(e, stage, out)
        if err is e:
            raise
        raise err from e
    return report
