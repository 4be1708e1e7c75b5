"""Finding the embedding and head tensors of a checkpoint, and how they are tied.

Targets come from what transformers states about the model class
(:mod:`embedq.jobs.archfacts`): the tied parameter pair ``_tied_weights_keys`` (head ->
input embedding), and how ``save_pretrained`` spells them, through transformers'
checkpoint conversion mapping (GPT-NeoX's head module ``lm_head`` is saved as
``embed_out.weight``). Those facts are cached, so the common case reads config.json and
the checkpoint's keys and imports neither torch nor transformers. Only when the
checkpoint's keys match none of the known spellings (another layout, a class without
``_tied_weights_keys``) is the model built on the meta device, every checkpoint key
renamed exactly as ``from_pretrained`` does, and the keys landing on the input / output
embedding taken. Name patterns are the last resort, for classes transformers cannot build.

Overlay module names follow the checkpoint's layout (its key minus ``.weight``): vLLM reads
checkpoint names, and the transformers back end maps them to its modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from embedq.errors import CheckpointError, TieError
from embedq.format.checkpoint import Checkpoint
from embedq.jobs import archfacts

EMBED_PATTERNS = (r"(^|\.)embed_tokens\.weight$", r"(^|\.)wte\.weight$", r"(^|\.)embed_in\.weight$",
                  r"(^|\.)word_embeddings\.weight$", r"(^|\.)tok_embeddings\.weight$")
HEAD_PATTERNS = (r"(^|\.)lm_head\.weight$", r"(^|\.)embed_out\.weight$", r"(^|\.)output\.weight$")
MTP_MARKERS = ("mtp.", "draft.", "eagle.")
# Per-layer input embeddings (Gemma 3n): gathered beside the input embedding, its largest table.
PER_LAYER_PATTERNS = (r"(^|\.)embed_tokens_per_layer\.weight$",)


@dataclass
class Targets:
    """What to quantize: ``embedding`` and ``head`` are checkpoint tensor names."""

    embedding: str
    head: str | None  # the head tensor if the checkpoint has a distinct one
    head_module: str | None  # module name of the output projection (even when tied);
    # None: the model class has no output embedding (an encoder such as BertModel)
    tied: bool
    extra_embeddings: list[str] = field(default_factory=list)  # MTP/draft embedding tensors
    source: str = "transformers"  # transformers (class facts) | skeleton | patterns | override
    per_layer: list[str] = field(default_factory=list)  # per-layer input embeddings (Gemma 3n)


def _is_mtp(name: str) -> bool:
    return any(m in name for m in MTP_MARKERS) or re.search(r"(^|\.)mtp(\.|_)", name) is not None


def _matches(ckpt: Checkpoint, spellings: list[str], prefix: str) -> list[str]:
    """Checkpoint keys among ``spellings`` (each also with ``base_model_prefix`` added or
    stripped, as ``from_pretrained`` does), best first, without duplicates."""
    out: list[str] = []
    for c in spellings:
        variants = [c]
        if prefix:
            variants.append(c[len(prefix) + 1:] if c.startswith(prefix + ".") else f"{prefix}.{c}")
        for v in variants:
            if ckpt.has(v) and v not in out and not _is_mtp(v):
                out.append(v)
    return out


def _from_facts(ckpt: Checkpoint, f: dict) -> tuple[str, str | None, str | None] | None:
    """``(embedding key, head key or None, head module)`` from cached class facts, or None
    when the checkpoint's keys do not decide it (then transformers renames them)."""
    emb_param, head_param = f.get("embedding"), f.get("head")
    spell = f.get("spellings") or {}
    prefix = f.get("base_model_prefix") or ""
    if not emb_param:
        return None
    embs = _matches(ckpt, spell.get(emb_param, [emb_param]), prefix)
    if len(embs) != 1:
        return None
    if not head_param:
        return embs[0], None, None
    head_spellings = spell.get(head_param, [head_param])
    heads = _matches(ckpt, head_spellings, prefix)
    if len(heads) > 1:
        return None
    if heads:
        return embs[0], heads[0], heads[0][: -len(".weight")]
    # No head tensor (tied, or a missing head): name the head module in the checkpoint's
    # layout. A checkpoint in the module tree's own layout (its embedding key is the module
    # parameter, and the saved spelling differs) names it as the module; otherwise as
    # save_pretrained spells it.
    emb_spell = spell.get(emb_param, [emb_param])
    if embs[0] == emb_param and len(emb_spell) > 1:
        head = head_spellings[0]
    else:
        head = head_spellings[min(1, len(head_spellings) - 1)]
    return embs[0], None, head[: -len(".weight")]


def _from_transformers(ckpt: Checkpoint) -> tuple[str, str | None, str | None] | None:
    """Build the meta-device skeleton and rename every checkpoint key as
    ``from_pretrained`` does (transformers' conversion mapping, base-model prefix);
    the keys landing on the input / output embedding are the targets."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except Exception:
        return None
    try:
        cls = archfacts.model_class(ckpt.config)
    except Exception:
        return None
    if cls is None:
        return None
    model = archfacts.skeleton(cls, ckpt.config)
    if model is None:
        return None
    in_mod, out_mod = archfacts.io_modules(model)
    if in_mod is None:
        return None
    try:
        conv = get_model_conversion_mapping(model)
    except Exception:
        conv = []
    converters = [t for t in conv if isinstance(t, WeightConverter)]
    renamings = [t for t in conv if not isinstance(t, WeightConverter)]
    meta = dict(model.state_dict())
    emb = head = None
    for key in ckpt.weight_map:
        if _is_mtp(key):
            continue
        try:
            name, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        except Exception:
            continue
        if name == in_mod + ".weight" and emb is None:
            emb = key
        elif out_mod and name == out_mod + ".weight" and head is None:
            head = key
    if emb is None:
        return None
    if head is not None:
        return emb, head, head[: -len(".weight")]
    if out_mod is None:
        return emb, None, None
    # Absent head: its saved spelling (the reversed renamings), in the embedding's layout.
    head_module = out_mod
    try:
        spell = archfacts.saved_spellings(out_mod + ".weight",
                                          archfacts.root_renamings(cls, ckpt.config.get("model_type")))
        head_module = spell[min(1, len(spell) - 1)][: -len(".weight")]
    except Exception:
        pass
    if emb != in_mod + ".weight":
        head_module = _default_head_module(emb, head_module)
    return emb, None, head_module


def _by_patterns(ckpt: Checkpoint, patterns) -> list[str]:
    return [n for n in ckpt.weight_map if any(re.search(p, n) for p in patterns) and not _is_mtp(n)]


def config_tie_flag(ckpt: Checkpoint) -> bool:
    """``tie_word_embeddings`` from text_config, the top level, or the model class default."""
    tc = ckpt.config.get("text_config")
    if isinstance(tc, dict) and "tie_word_embeddings" in tc:
        return bool(tc["tie_word_embeddings"])
    if "tie_word_embeddings" in ckpt.config:
        return bool(ckpt.config["tie_word_embeddings"])
    f = archfacts.cached_facts(ckpt.config)
    if f is not None and f.get("tie_default") is not None:
        return bool(f["tie_default"])
    cfg = archfacts.hf_config(ckpt.config)
    if cfg is not None:
        try:
            return bool(getattr(cfg.get_text_config(), "tie_word_embeddings", True))
        except Exception:
            pass
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
        try:
            auto = _discover(ckpt, tied_cfg)
        except CheckpointError:
            auto = None
        _check_override(ckpt, list(override), auto)
        emb = override[0]
        if len(override) > 1:
            head = override[1]
            head_module = head[: -len(".weight")]
        else:  # only the embedding named: the head is the model's own (quantized only with --lm-head)
            head = auto.head if auto is not None and auto.head not in (None, emb) else None
            head_module = auto.head_module if auto is not None else _default_head_module(emb, "lm_head")
        t = Targets(emb, head, head_module, tied_cfg, [], "override",
                    auto.per_layer if auto is not None else per_layer_tables(ckpt))
    else:
        t = _discover(ckpt, tied_cfg)
    _check_vocab(ckpt, t.embedding)
    return t, tied_cfg


def _check_override(ckpt: Checkpoint, names: list[str], auto: Targets | None) -> None:
    """Refuse a ``--targets`` list that is not ``embedding[,head]`` of this model, each
    message saying what to pass (the model's own targets, when they are known)."""
    given = f"{ckpt.path}: --targets {','.join(names)!r}"
    if auto is not None:
        fix = f"pass --targets {auto.embedding}" + (f"[,{auto.head}]" if auto.head else "")
    else:
        fix = "pass the input embedding's tensor name, optionally a comma and the head's (as in the checkpoint)"
    if len(names) > 2:
        raise CheckpointError(f"{given}: {len(names)} names; it takes the embedding tensor and optionally "
                              f"the head tensor: {fix}")
    if "" in names:
        raise CheckpointError(f"{given}: an empty name (a stray comma?); {fix}")
    if len(set(names)) < len(names):
        raise CheckpointError(f"{given}: names {names[0]} twice; {fix}")
    for n in names:
        if not ckpt.has(n):
            hint = f"did you mean {n}.weight?" if ckpt.has(n + ".weight") else fix
            raise CheckpointError(f"{ckpt.path}: no tensor {n!r} in the checkpoint (--targets); {hint}")
        ckpt.tensor(n)  # its shard holds it (the error names the file)
    allowed = candidate_tensors(ckpt)
    if auto is not None:
        allowed |= {x for x in (auto.embedding, auto.head, *auto.extra_embeddings) if x}
    per_layer = set(auto.per_layer if auto is not None else per_layer_tables(ckpt))
    for n in names:
        if n in per_layer:
            raise CheckpointError(f"{given}: {n} is a per-layer input embedding; --per-layer-embeddings "
                                  f"quantizes it beside the input embedding: {fix}")
        if n not in allowed:
            raise CheckpointError(f"{ckpt.path}: --targets {n} is not an input or output embedding "
                                  f"(or MTP/draft table) of this model; embedq quantizes only those: {fix}")
    first = names[0]
    # the model's own targets decide where they are known (a table saved under a head's name
    # may be its only embedding); the names' patterns only where they are not
    if (first == auto.head and first != auto.embedding) if auto is not None else (
            any(re.search(p, first) for p in HEAD_PATTERNS) and not any(re.search(p, first) for p in EMBED_PATTERNS)):
        if auto is None:
            _refuse_head_only(ckpt)
        raise CheckpointError(f"{given}: {first} is the output embedding (the head); the input embedding "
                              f"comes first: {fix}")


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
    found = None
    source = "transformers"
    f = archfacts.facts(ckpt.config, allow_skeleton=True)
    if f is not None:
        found = _from_facts(ckpt, f)
    if found is None:
        found = _from_transformers(ckpt)
        source = "skeleton"
    if found is not None:
        emb, head, head_module = found
    else:
        source = "patterns"
        hits = _by_patterns(ckpt, EMBED_PATTERNS)
        if not hits:
            _refuse_head_only(ckpt)
        if len(hits) != 1:
            what = "no embedding tensors" if not hits else \
                f"{len(hits)} candidate embedding tensors ({', '.join(hits[:4])})"
            raise CheckpointError(f"{ckpt.path}: found {what}; name them with --targets")
        emb = hits[0]
        heads = _by_patterns(ckpt, HEAD_PATTERNS)
        head = heads[0] if len(heads) == 1 else None
        head_module = head[: -len(".weight")] if head else _default_head_module(emb, "lm_head")
    if head == emb:
        head = None
    extras = []
    emb_shape = ckpt.tensor(emb).shape
    for n in ckpt.weight_map:
        if n != emb and _is_mtp(n) and any(re.search(p, n) for p in EMBED_PATTERNS):
            if ckpt.tensor(n).shape == emb_shape:
                extras.append(n)
    return Targets(emb, head, head_module, tied_cfg, sorted(extras), source, per_layer_tables(ckpt))


def per_layer_tables(ckpt: Checkpoint) -> list[str]:
    """The checkpoint's per-layer input embeddings (2-D tensors named like Gemma 3n's)."""
    return sorted(n for n in ckpt.weight_map if any(re.search(p, n) for p in PER_LAYER_PATTERNS)
                  and not _is_mtp(n) and len(ckpt.tensor(n).shape) == 2)



def _refuse_head_only(ckpt: Checkpoint) -> None:
    """A checkpoint whose only vocabulary table is saved under a head's name (a tied table
    some exporters store as ``lm_head.weight``): say so, and how to get one embedq reads."""
    heads = _by_patterns(ckpt, HEAD_PATTERNS)
    if heads and not _by_patterns(ckpt, EMBED_PATTERNS):
        raise CheckpointError(
            f"{ckpt.path}: the checkpoint stores no input embedding, only the head {heads[0]} (a tied "
            "table saved under the head's name?); embedq quantizes the input embedding and the head "
            "beside it: load and save the model with transformers (save_pretrained stores a tied "
            "table as the embedding) and quantize that")


def _default_head_module(emb: str, head: str) -> str:
    """The head module in the layout of a checkpoint whose embedding key is ``emb``."""
    if emb.startswith("model.language_model."):
        return "lm_head"
    if emb.startswith("language_model.") and "." not in head:
        return "language_model." + head
    return head


def resolve_ties(targets: Targets, tied_cfg: bool, identical: bool | None,
                 trust: str | None, where: str) -> bool:
    """Apply the contract's tie rules; return whether the model is treated as tied.

    ``identical`` tells whether a present head tensor is bit-identical to the
    embedding (None when there is no head tensor).
    """
    has_head = targets.head is not None
    if targets.head_module is None and not has_head:
        return False  # no output embedding at all (an encoder): nothing to tie
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
