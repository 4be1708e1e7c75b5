"""Finding the embedding and head tensors of a checkpoint, and how they are tied.

Targets come from the model skeleton built on the meta device (no weights):
transformers' ``get_input_embeddings()`` / ``get_output_embeddings()``, mapped to
checkpoint tensor names. Name patterns are only the fallback for architectures
transformers cannot build.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from dataclasses import dataclass, field

from embedq.errors import CheckpointError, TieError
from embedq.format.checkpoint import Checkpoint

EMBED_PATTERNS = (r"(^|\.)embed_tokens\.weight$", r"(^|\.)wte\.weight$", r"(^|\.)embed_in\.weight$",
                  r"(^|\.)word_embeddings\.weight$", r"(^|\.)tok_embeddings\.weight$")
HEAD_PATTERNS = (r"(^|\.)lm_head\.weight$", r"(^|\.)embed_out\.weight$", r"(^|\.)output\.weight$")
MTP_MARKERS = ("mtp.", "draft.", "eagle.")


@dataclass
class Targets:
    """What to quantize: ``embedding`` and ``head`` are checkpoint tensor names."""

    embedding: str
    head: str | None  # the head tensor if the checkpoint has a distinct one
    head_module: str  # module name of the output projection (even when tied)
    tied: bool
    extra_embeddings: list[str] = field(default_factory=list)  # MTP/draft embedding tensors
    source: str = "skeleton"  # skeleton | patterns | override


def _is_mtp(name: str) -> bool:
    return any(m in name for m in MTP_MARKERS) or re.search(r"(^|\.)mtp(\.|_)", name) is not None


def _module_names_from_skeleton(config: dict) -> tuple[str, str | None] | None:
    """Module names of the input / output embedding in a meta-device skeleton."""
    try:
        import torch  # noqa: F401
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        try:
            from transformers import AutoModelForImageTextToText
        except ImportError:  # pragma: no cover
            AutoModelForImageTextToText = None
        cfg_cls_input = dict(config)
        cfg_cls_input.pop("quantization_config", None)
        model_type = cfg_cls_input.pop("model_type", None)
        if model_type is None:
            return None
        cfg = AutoConfig.for_model(model_type, **cfg_cls_input)
    except Exception:
        return None
    builders = [AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel]
    model = None
    for b in builders:
        if b is None:
            continue
        try:
            # Quiet: transformers logs warnings about unused config keys.
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                logging.disable(logging.WARNING)
                try:
                    with init_empty_weights():
                        model = b.from_config(cfg)
                finally:
                    logging.disable(logging.NOTSET)
            break
        except Exception:
            continue
    if model is None:
        return None
    try:
        inp = model.get_input_embeddings()
    except Exception:
        return None
    try:
        out = model.get_output_embeddings()
    except Exception:
        out = None
    names = {id(m): n for n, m in model.named_modules()}
    in_name = names.get(id(inp)) if inp is not None else None
    out_name = names.get(id(out)) if out is not None else None
    if in_name is None:
        return None
    return in_name, out_name


def _map_to_checkpoint(ckpt: Checkpoint, module: str) -> str | None:
    """Map a transformers module name to the checkpoint's tensor name.

    Checkpoint keys may use an older layout than the module tree
    (``language_model.model.embed_tokens`` vs ``model.language_model.embed_tokens``),
    so match the longest unambiguous suffix.
    """
    exact = module + ".weight"
    if ckpt.has(exact):
        return exact
    parts = exact.split(".")
    for k in range(len(parts), 1, -1):
        suffix = ".".join(parts[-k:])
        hits = [n for n in ckpt.weight_map if (n == suffix or n.endswith("." + suffix)) and not _is_mtp(n)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            lm = [h for h in hits if "language_model" in h or "text" in h]
            if len(lm) == 1:
                return lm[0]
    return None


def _by_patterns(ckpt: Checkpoint, patterns) -> list[str]:
    return [n for n in ckpt.weight_map if any(re.search(p, n) for p in patterns) and not _is_mtp(n)]


def config_tie_flag(ckpt: Checkpoint) -> bool:
    """``tie_word_embeddings`` from text_config, the top level, or the model class default."""
    tc = ckpt.config.get("text_config")
    if isinstance(tc, dict) and "tie_word_embeddings" in tc:
        return bool(tc["tie_word_embeddings"])
    if "tie_word_embeddings" in ckpt.config:
        return bool(ckpt.config["tie_word_embeddings"])
    try:
        from transformers import AutoConfig
        cfg = dict(ckpt.config)
        cfg.pop("quantization_config", None)
        c = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        return bool(getattr(c.get_text_config(), "tie_word_embeddings", True))
    except Exception:
        return True  # PretrainedConfig's default


def candidate_tensors(ckpt: Checkpoint) -> set[str]:
    """Tensors an overlay may replace: input/output embeddings and MTP/draft tables
    (by name), whatever the skeleton says."""
    per_layer = re.compile(r"(^|\.)layers?\.\d+\.")  # e.g. layers.0.attention.output.weight
    return {n for n in ckpt.weight_map if any(re.search(p, n) for p in EMBED_PATTERNS)
            or (any(re.search(p, n) for p in HEAD_PATTERNS) and not per_layer.search(n))}


def find_targets(ckpt: Checkpoint, override: list[str] | None = None) -> tuple[Targets, bool]:
    """Locate the embedding (and head) tensors; returns (targets, config_says_tied).

    ``override`` (``--targets``): the embedding tensor, optionally followed by the head
    tensor; each must be one of the model's embeddings, heads or MTP/draft tables.
    """
    tied_cfg = config_tie_flag(ckpt)
    if override:
        if len(override) > 2:
            raise CheckpointError(f"--targets takes the embedding tensor and optionally the head tensor, "
                                  f"got {len(override)} names ({', '.join(override)})")
        for n in override:
            ckpt.tensor(n)  # raises with the file name if missing
        try:
            auto = _discover(ckpt, tied_cfg)
        except CheckpointError:
            auto = None
        allowed = candidate_tensors(ckpt)
        if auto is not None:
            allowed |= {x for x in (auto.embedding, auto.head, *auto.extra_embeddings) if x}
        for n in override:
            if n not in allowed:
                raise CheckpointError(f"{ckpt.path}: --targets {n} is not an input or output embedding "
                                      "(or MTP/draft table) of this model; embedq quantizes only those")
        emb = override[0]
        if len(override) > 1:
            head = override[1]
            head_module = head[: -len(".weight")]
        else:  # only the embedding named: the head is the model's own (quantized only with --lm-head)
            head = auto.head if auto is not None and auto.head not in (None, emb) else None
            head_module = auto.head_module if auto is not None else _default_head_module(emb)
        t = Targets(emb, head, head_module, tied_cfg, [], "override")
    else:
        t = _discover(ckpt, tied_cfg)
    _check_vocab(ckpt, t.embedding)
    return t, tied_cfg


def _check_vocab(ckpt: Checkpoint, emb: str) -> None:
    """A table with fewer rows than ``vocab_size`` means the config and weights disagree."""
    cfgs = [ckpt.config.get("text_config"), ckpt.config]
    vocab = next((c["vocab_size"] for c in cfgs if isinstance(c, dict) and "vocab_size" in c), None)
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    info = ckpt.tensor(emb)
    rows = info.shape[0] if info.shape else 0
    if rows < vocab:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: vocab_size is {vocab} but {emb} has {rows} rows "
                              f"({ckpt.path / info.file}); config and weights disagree")


def _discover(ckpt: Checkpoint, tied_cfg: bool) -> Targets:
    emb = head = None
    head_module = None
    source = "skeleton"
    names = _module_names_from_skeleton(ckpt.config)
    if names:
        in_mod, out_mod = names
        emb = _map_to_checkpoint(ckpt, in_mod)
        head_module = out_mod
        if out_mod:
            head = _map_to_checkpoint(ckpt, out_mod)
    if emb is None:
        source = "patterns"
        hits = _by_patterns(ckpt, EMBED_PATTERNS)
        if len(hits) != 1:
            what = "no" if not hits else f"{len(hits)} candidate"
            raise CheckpointError(
                f"{ckpt.path}: found {what} embedding tensors ({', '.join(hits[:4])}); "
                "name them with --targets")
        emb = hits[0]
        heads = _by_patterns(ckpt, HEAD_PATTERNS)
        head = heads[0] if len(heads) == 1 else None
    if head == emb:
        head = None
    if head is not None:
        head_module = head[: -len(".weight")]
    elif head_module is None or (names and emb != names[0] + ".weight"):
        # The checkpoint uses another layout than the module tree: name the
        # (absent, tied) head in the checkpoint's layout, as back ends see it.
        head_module = _default_head_module(emb)
    extras = []
    emb_shape = ckpt.tensor(emb).shape
    for n in ckpt.weight_map:
        if n != emb and _is_mtp(n) and any(re.search(p, n) for p in EMBED_PATTERNS):
            if ckpt.tensor(n).shape == emb_shape:
                extras.append(n)
    return Targets(emb, head, head_module, tied_cfg, sorted(extras), source)



def _default_head_module(emb: str) -> str:
    if emb.startswith("model.language_model."):
        return "lm_head"
    if emb.startswith("language_model."):
        return "language_model.lm_head"
    return "lm_head"


def resolve_ties(targets: Targets, tied_cfg: bool, identical: bool | None,
                 trust: str | None, where: str) -> bool:
    """Apply the contract's tie rules; return whether the model is treated as tied.

    ``identical`` tells whether a present head tensor is bit-identical to the
    embedding (None when there is no head tensor).
    """
    has_head = targets.head is not None
    if tied_cfg and not has_head:
        return True
    if tied_cfg and has_head:
        if identical:
            return True
        if trust == "config":
            return True
        if trust == "tensors":
            return False
        raise TieError(
            f"{where}: config.json says tie_word_embeddings=true but {targets.head} differs from "
            f"{targets.embedding}; pass --trust-config (tie, drop the head tensor's values) or "
            "--trust-tensors (treat as untied)")
    if not tied_cfg and has_head:
        return False
    # untied per config, but no head tensor
    if trust == "tensors":
        return True
    raise TieError(
        f"{where}: config.json says tie_word_embeddings=false but the checkpoint has no "
        f"lm_head tensor; pass --trust-tensors to treat it as tied")
