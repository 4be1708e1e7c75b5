"""The result of a run: per-module numbers, a printable table and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass
class ModuleReport:
    module: str
    tensor: str
    shape: list[int]
    scheme: str
    source_dtype: str
    bytes_before: int
    bytes_after: int
    max_abs_error: float | None = None
    rms_error: float | None = None
    rel_rms_error: float | None = None
    role: str = "embedding"
    aliases: list[str] = field(default_factory=list)


def _finite_or_null(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_or_null(x) for x in v]
    return v


@dataclass
class Report:
    """What ``embedq quantize`` (or ``verify``) did; ``str(report)`` is the summary table."""

    path: str
    mode: str  # in-place | derived | derived (compressed-tensors) | verify | apply
    modules: list[ModuleReport]
    tied: bool
    overlay: str | None = None
    output: str | None = None
    seconds: float | None = None
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def bytes_before(self) -> int:
        return sum(m.bytes_before for m in self.modules)

    @property
    def bytes_after(self) -> int:
        return sum(m.bytes_after for m in self.modules)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bytes_before=self.bytes_before, bytes_after=self.bytes_after,
                 bytes_saved=self.bytes_saved)
        return d

    def to_json(self, **kw) -> str:
        # JSON has no NaN/Infinity (json.dumps would emit them and break every strict
        # parser): a non-finite number, e.g. an error statistic that overflowed, is null.
        return json.dumps(_finite_or_null(self.to_dict()), indent=2, allow_nan=False, **kw)

    def table(self) -> str:
        head = ["module", "shape", "scheme", "MB before", "MB after", "max err", "rms err"]
        rows = []
        for m in self.modules:
            name = m.module + (f" (= {', '.join(m.aliases)})" if m.aliases else "")
            rows.append([
                name, "x".join(map(str, m.shape)), m.scheme,
                f"{m.bytes_before / 1e6:.1f}", f"{m.bytes_after / 1e6:.1f}",
                "-" if m.max_abs_error is None else f"{m.max_abs_error:.3g}",
                "-" if m.rms_error is None else f"{m.rms_error:.3g}",
            ])
        rows.append(["total", "", "", f"{self.bytes_before / 1e6:.1f}", f"{self.bytes_after / 1e6:.1f}",
                     "", ""])
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(r, widths)))
        lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
        if self.bytes_before:
            lines.append(f"saved {self.bytes_saved / 1e6:.1f} MB "
                         f"({100 * self.bytes_saved / self.bytes_before:.1f}%), tied={self.tied}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def to_model_card(self, **kwargs) -> str:
        """The Hub model card (README.md text) for this run; see
        :func:`embedq.jobs.card.render_report_card` for ``base_model``, ``base_revision``,
        ``eval_results``, ``repo_id``, ``license``."""
        from embedq.jobs.card import render_report_card
        return render_report_card(self, **kwargs)

    def __str__(self) -> str:
        return self.table()
