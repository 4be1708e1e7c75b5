"""Text, tokenizer and float-model loading for calibration and evaluation.

:func:`collect_calibration` runs the float checkpoint on calibration text and returns the
:class:`embedq.quant.gptq.Calibration` that ``--method gptq`` quantizes against; the text
and context helpers are shared with :mod:`embedq.quality.evaluate`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import warnings
from pathlib import Path

import torch

from embedq.errors import EvalError, SchemeError
from embedq.format.checkpoint import check_folder_reads, check_weights
from embedq.format.constants import QUANT_METHOD
from embedq.format.files import inside
from embedq.jobs.archfacts import transformers_config
from embedq.quant.gptq import DEFAULT_DAMP, Calibration

CALIB_CONTEXTS = 48
CALIB_LENGTH = 128

# Standard-library modules whose docstrings make the default calibration text: present in
# every CPython, technical English with code fragments, and not the pydoc topics that
# ``embedq eval`` scores.
CALIB_MODULES = ("collections", "functools", "itertools", "json", "os", "pathlib", "re",
                 "subprocess", "typing", "unittest", "argparse", "logging", "asyncio", "email",
                 "http.client", "urllib.request", "threading", "dataclasses", "datetime", "decimal")

def default_text() -> tuple[str, str]:
    """(text, description): Python's bundled reference-manual topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        raise EvalError("this Python has no pydoc_data (needed for the default text); pass --text FILE") from None
    text = "\n\n".join(topics[k] for k in sorted(topics))
    v = ".".join(map(str, sys.version_info[:3]))
    return text, f"pydoc_data/topics.py (Python {v})"


def read_text(path: str | os.PathLike) -> tuple[str, str]:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except FileNotFoundError:
        raise EvalError(f"{p}: text file not found") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def make_contexts(tokens: list[int] | torch.Tensor, contexts: int, length: int,
                  bos: int | None) -> torch.Tensor:
    """``contexts`` rows of ``length`` tokens: BOS + ``length - 1`` text tokens each.

    Text windows do not overlap and are spread evenly over the whole text.
    """
    toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if length < 2:
        raise EvalError(f"--length {length}: need at least 2 tokens per context")
    if contexts < 1:
        raise EvalError(f"--contexts {contexts}: need at least one context")
    body = length - 1 if bos is not None else length
    avail = toks.numel() // body
    if avail < contexts:
        raise EvalError(f"the text has {toks.numel()} tokens: room for {avail} contexts of "
                        f"{length} tokens, {contexts} requested (use a longer --text or fewer --contexts)")
    rows = []
    for i in range(contexts):
        k = i * avail // contexts
        w = toks[k * body:(k + 1) * body]
        rows.append(torch.cat([torch.tensor([bos]), w]) if bos is not None else w)
    return torch.stack(rows)

def quiet_transformers():
    import contextlib

    @contextlib.contextmanager
    def cm():
        from transformers.utils import logging as tlog
        old = tlog.get_verbosity()
        bars = tlog.is_progress_bar_enabled()
        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
        try:
            yield
        finally:
            tlog.set_verbosity(old)
            if bars:
                tlog.enable_progress_bar()
    return cm()

def load_reference(reference: Path, model_class, dtype: torch.dtype, device: str | None = None):
    """The float model: the checkpoint loaded with its embedq quantization_config removed."""
    check_folder_reads(reference)
    check_weights(reference)
    cfg = transformers_config(reference)
    for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
        qc = getattr(c, "quantization_config", None)
        if qc is not None:
            qd = qc if isinstance(qc, dict) else qc.to_dict()
            if qd.get("quant_method") != QUANT_METHOD:
                raise EvalError(f"{reference}: has a {qd.get('quant_method')!r} quantization; "
                                "embedq eval compares float checkpoints only")
            try:
                delattr(c, "quantization_config")
            except AttributeError:
                c.quantization_config = None
    with quiet_transformers():
        model = model_class.from_pretrained(str(reference), config=cfg, dtype=dtype,
                                            **({"device_map": device} if device else {}))
    return model.eval()

def load_tokenizer(folder: Path):
    import transformers
    check_folder_reads(folder)
    try:
        with quiet_transformers():
            return transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types here
        raise EvalError(f"{folder}: no usable tokenizer ({type(e).__name__}); copy the tokenizer "
                        "files into the checkpoint folder or pass token ids") from None


def text_contexts(tokenizer, text: str, contexts: int, length: int, bos: int | None) -> torch.Tensor:
    """Contexts from ``text`` without tokenizing all of it.

    The text is cut into ``contexts`` equal parts; each context is BOS + the first
    ``length - 1`` tokens of its part, starting at the part's first line break, so the
    windows never overlap and cover the whole text evenly.
    """
    if length < 2:
        raise EvalError(f"--length {length}: need at least 2 tokens per context")
    if contexts < 1:
        raise EvalError(f"--contexts {contexts}: need at least one context")
    body = length - 1 if bos is not None else length
    part = len(text) // contexts
    rows = []
    for i in range(contexts):
        a, end = i * part, (i + 1) * part
        nl = text.find("\n", a, end)
        a = nl + 1 if i and nl >= 0 else a
        ids: list[int] = []
        span = 16 * body
        while True:
            ids = tokenizer(text[a:min(end, a + span)], add_special_tokens=False)["input_ids"]
            if len(ids) > body or a + span >= end:
                break
            span *= 2
        if len(ids) < body:
            raise EvalError(f"the text is too short for {contexts} contexts of {length} tokens "
                            f"(part {i + 1} has {len(ids)} tokens); use a longer --text or fewer --contexts")
        w = torch.tensor(ids[:body], dtype=torch.long)
        rows.append(torch.cat([torch.tensor([bos]), w]) if bos is not None else w)
    return torch.stack(rows)

def config_bos(p: Path) -> int | None:
    try:
        cfg = json.loads(inside(p, "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    bos = (text if isinstance(text, dict) else {}).get("bos_token_id", cfg.get("bos_token_id"))
    return bos if type(bos) is int and bos >= 0 else None

def default_calibration_text() -> tuple[str, str]:
    """(text, description): docstrings of :data:`CALIB_MODULES`, in a fixed order."""
    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CALIB_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover - stripped Python builds
                continue
            for _, obj in sorted(vars(mod).items()):
                d = getattr(obj, "__doc__", None)
                if isinstance(d, str) and len(d) > 200 and (inspect.isfunction(obj) or inspect.isclass(obj)):
                    docs.append(inspect.cleandoc(d))
    text = "\n\n".join(dict.fromkeys(docs))  # dedupe, keep order
    import sys
    v = ".".join(map(str, sys.version_info[:3]))
    return text, f"standard-library docstrings (Python {v})"


def _head_module(model):
    head = model.get_output_embeddings()
    if head is None:
        raise SchemeError("the model has no output head: --method gptq is for tables a head multiplies")
    return head


@torch.no_grad()
def collect_calibration(path: str | os.PathLike, *, text: str | os.PathLike | None = None,
                        contexts: int = CALIB_CONTEXTS, length: int = CALIB_LENGTH,
                        damp: float = DEFAULT_DAMP, progress: bool = False) -> Calibration:
    """Run the float checkpoint at ``path`` on calibration text; return ``E[h h^T]``.

    ``h`` is the input of the output head (captured with a forward hook), so any model
    whose ``get_output_embeddings()`` is a linear head works. The BOS row is protected.
    """
    import transformers
    p = Path(path)
    body, desc = read_text(text) if text is not None else default_calibration_text()
    tok = load_tokenizer(p)
    bos = tok.bos_token_id if tok.bos_token_id is not None else config_bos(p)
    ids = text_contexts(tok, body, contexts, length, bos)
    cfg = transformers_config(p)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM
    model = load_reference(p, cls, torch.float32)
    head = _head_module(model)
    acc: dict[str, torch.Tensor | int] = {"h": None, "n": 0}

    def hook(_m, inputs):
        h = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
        acc["h"] = h.T @ h if acc["h"] is None else acc["h"] + h.T @ h
        acc["n"] += h.shape[0]

    handle = head.register_forward_pre_hook(hook)
    try:
        it = range(ids.shape[0])
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(it, desc="calibration", unit="ctx", leave=False)
        for i in it:
            model(input_ids=ids[i:i + 1], use_cache=False)
    finally:
        handle.remove()
    hess = acc["h"] / acc["n"]
    protected = torch.empty(0, hess.shape[0])
    if bos is not None:
        emb = model.get_input_embeddings().weight
        protected = emb[bos:bos + 1].detach().float().clone()
    del model
    return Calibration(hess, protected, damp, desc, int(acc["n"]))


__all__ = ["collect_calibration", "default_calibration_text", "default_text", "read_text",
           "make_contexts", "text_contexts", "load_tokenizer", "load_reference", "config_bos",
           "quiet_transformers"]
