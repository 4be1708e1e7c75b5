"""The one description of a ``quantize`` request: :class:`QuantizeRecipe`.

It is built and validated once, where a request enters (the ``embedq quantize`` command,
:func:`embedq.quantize`, the ``--max-kld``/``--auto`` selection, which only fills in the
scheme it chose), and passed down unchanged to the jobs that write it
(:mod:`embedq.jobs.quantize`, :mod:`embedq.jobs.derived`). As compressed-tensors parses
its recipe into ``QuantizationArgs`` at the edge, the writers here never see loose options.

A new option is one field here (with its default and its check in ``__post_init__``),
its flag in ``embedq/cli/app.py:quantize``, and a test (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedq.errors import EmbedqError, SchemeError
from embedq.format.scheme import DEFAULT_BITS, Scheme

FORMATS = ("embedq", "compressed-tensors")
TRUST = (None, "config", "tensors")
# --auto: twice LOSSY_KLD (embedq.jobs.advice), a KLD users call near-lossless.
AUTO_MAX_KLD = 0.01


@dataclass(frozen=True)
class SchemeSearch:
    """``--max-kld`` / ``--auto``: the scheme is the smallest overlay whose KLD on a sample is
    at most ``max_kld`` (:mod:`embedq.quality.select` chooses it), among the candidates of
    ``bits`` (``--bits``) when given, else among all of them."""

    max_kld: float = AUTO_MAX_KLD
    method: str | None = None  # None: gptq when a head reads the table, else mse
    scale_dtype: str | None = None
    bits: int | None = None  # None: every bit width

    def __post_init__(self) -> None:
        k = self.max_kld
        if not isinstance(k, numbers.Real) or isinstance(k, bool) or not math.isfinite(k) or k <= 0:
            raise SchemeError(f"--max-kld {k!r}: must be a positive number (nats per token)")
        if self.bits is not None:
            Scheme(bits=self.bits)  # refuses what --bits refuses, with its words


@dataclass(frozen=True)
class QuantizeRecipe:
    """What to quantize, how, and where to write it.

    ``scheme`` is the table's scheme (``None`` only while ``search`` is still to choose
    it); ``head_scheme`` an untied or tied head's own scheme (``None``: the table's).
    ``eval_results`` is an ``embedq eval`` result dict or JSON file, for the model card;
    ``calibration`` (:func:`embedq.jobs.calibration.collect_calibration`) is what gptq
    quantizes against, collected from the checkpoint when not given.
    """

    scheme: Scheme | None = field(default_factory=lambda: Scheme.default(DEFAULT_BITS))
    head_scheme: Scheme | None = None
    fit_default: bool = True  # the grouping was not given: fit the default to each width (Scheme.fit)
    lm_head: bool = False
    per_layer_embeddings: bool = False  # Gemma 3n's embed_tokens_per_layer too
    targets: tuple[str, ...] | None = None
    trust: str | None = None
    output: Path | None = None
    overlay_only: bool = False
    force: bool = False
    format: str = "embedq"
    search: SchemeSearch | None = None
    chunk_rows: int | None = None
    progress: bool = True
    base_model: str | None = None
    base_revision: str | None = None
    eval_results: Any = None
    calibration: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Types first (embedq.quantize passes Python values straight in): a wrong type
        # fails here, named, not deep inside the job.
        for k in ("scheme", "head_scheme"):
            v = getattr(self, k)
            if v is not None and not isinstance(v, Scheme):
                raise SchemeError(f"{k} {v!r}: must be an embedq Scheme or None")
        for k in ("fit_default", "lm_head", "per_layer_embeddings", "overlay_only", "force", "progress"):
            if not isinstance(getattr(self, k), bool):
                raise EmbedqError(f"{k} {getattr(self, k)!r}: must be True or False")
        if self.search is not None and not isinstance(self.search, SchemeSearch):
            raise SchemeError(f"search {self.search!r}: must be a SchemeSearch or None")
        if self.targets is not None:
            # one name, not its characters
            targets = (self.targets,) if isinstance(self.targets, str) else self.targets
            try:
                targets = tuple(targets)
            except TypeError:
                raise EmbedqError(f"targets {self.targets!r}: must be a tensor name or a list of them") from None
            # an empty name is refused with the model's own targets (jobs/targets.py)
            if not targets or not all(isinstance(t, str) for t in targets):
                raise EmbedqError(f"targets {self.targets!r}: must be a tensor name or a list of them")
            object.__setattr__(self, "targets", targets)
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))
        c = self.chunk_rows
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise SchemeError(f"--chunk-rows {c!r}: must be a positive number of rows")
        if self.trust not in TRUST:
            raise EmbedqError(f"trust {self.trust!r}: expected 'config', 'tensors' or None")
        if self.format not in FORMATS:
            raise EmbedqError(f"--format {self.format!r}: expected embedq or compressed-tensors")
        if self.search is not None and self.format != "embedq":
            raise EmbedqError("--max-kld/--auto write the embedq format only")
        if self.search is not None and self.per_layer_embeddings:  # the search measures the main table
            raise EmbedqError("--max-kld/--auto choose the input embedding's scheme; with "
                              "--per-layer-embeddings pass the scheme (--bits, --group-size)")
        if (self.scheme is None) != (self.search is not None):
            raise SchemeError("a recipe has a scheme, or a search that chooses one")
        if self.format == "compressed-tensors":
            if self.output is None:
                raise SchemeError("--format compressed-tensors writes a derived checkpoint: pass --output DIR")
            if self.overlay_only:  # the format lives in config.json, which a bundle has not
                raise SchemeError("--format compressed-tensors writes a full derived checkpoint (its "
                                  "config.json carries the format); drop --overlay-only or --format")
            if self.per_layer_embeddings:  # not tried with stock vLLM's compressed-tensors
                raise SchemeError("--per-layer-embeddings writes the embedq format; drop --format "
                                  "compressed-tensors or --per-layer-embeddings")
            if not self.scheme.symmetric:
                raise SchemeError("--format compressed-tensors: stock vLLM serves only symmetric embedding "
                                  "tables; drop --asym or use the default embedq format")
        if self.overlay_only and self.output is None:  # refused, not ignored: in place is no bundle
            raise EmbedqError("--overlay-only writes an overlay bundle to --output DIR: pass --output DIR "
                              "(without it the overlay is added to the model's own folder)")

    @classmethod
    def from_options(cls, bits: int | None = None, *, group_size: int | None = None,
                     symmetric: bool | None = None, method: str | None = None,
                     scale_dtype: str | None = None, head_bits: int | None = None,
                     head_group_size: int | None = None, head_symmetric: bool | None = None,
                     max_kld: float | None = None, auto: bool = False,
                     **fields) -> "QuantizeRecipe":
        """The recipe of the flat options the command line and :func:`embedq.quantize` take.

        The scheme options (``bits``, ``group_size`` (0: per row), ``symmetric``, ``method``,
        ``scale_dtype``, ``head_*``) become :class:`Scheme` values, what is not given taken
        from :data:`embedq.format.scheme.DEFAULT_SCHEMES`; ``max_kld`` / ``auto`` a
        :class:`SchemeSearch` (``bits``, when given, narrows it to that width's candidates);
        every other option is a field of the recipe.
        """
        if auto or max_kld is not None:
            if group_size is not None or symmetric is not None or head_bits is not None \
                    or head_group_size is not None or head_symmetric is not None:
                raise EmbedqError("--max-kld/--auto choose bits (among --bits' schemes when given), "
                                  "group size and symmetry; "
                                  "drop --group-size/--asym/--sym/--head-bits/--head-group-size")
            search = SchemeSearch(AUTO_MAX_KLD if max_kld is None else max_kld, method, scale_dtype, bits)
            return cls(scheme=None, search=search, **fields)
        scheme = Scheme.default(bits, symmetric, group_size, method, scale_dtype)
        head = None
        if head_bits is not None or head_group_size is not None or head_symmetric is not None:
            hb = scheme.bits if head_bits is None else head_bits
            # the table's grouping carries over to a head of the same bits
            hg = head_group_size if head_group_size is not None else (
                (scheme.group_size or 0) if hb == scheme.bits else None)
            head = Scheme.default(hb, scheme.symmetric if head_symmetric is None else head_symmetric,
                                  hg, scheme.method, scale_dtype)
        return cls(scheme=scheme, head_scheme=head, fit_default=group_size is None, **fields)

    def chosen(self, scheme: Scheme, calibration=None) -> "QuantizeRecipe":
        """This recipe with the scheme its search chose (and the calibration it measured with)."""
        return dataclasses.replace(self, scheme=scheme, search=None, fit_default=False,
                                   calibration=self.calibration if calibration is None else calibration)

    @property
    def method(self) -> str | None:
        return self.scheme.method if self.scheme is not None else self.search.method


__all__ = ["QuantizeRecipe", "SchemeSearch", "AUTO_MAX_KLD", "FORMATS"]
