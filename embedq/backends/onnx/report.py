"""What :func:`~embedq.backends.onnx.patch.patch_model` did: one row per replaced node."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class OnnxModuleReport:
    """One replaced Gather or MatMul/Gemm: the overlay table it now reads, bytes before and after."""
    module: str
    table: str  # overlay module owning the bytes
    op: str
    node: str
    replaced: str  # float initializer replaced
    scheme: str
    bits: int
    block_size: int
    blocks_per_row: int
    source_check: str
    float_bytes: int
    quantized_bytes: int  # 0 when the bytes are shared with another module
    #: row parts of a table split under max_tensor_bytes: {"rows": [start, stop], "bytes": n}
    #: (empty: one part, the whole table)
    parts: list = field(default_factory=list)


@dataclass
class OnnxReport:
    """One patched graph: its modules, sizes and warnings; :meth:`table` is the CLI's text."""
    model: str
    output: str
    overlay: str
    modules: list[OnnxModuleReport]
    initializer_bytes_before: int
    initializer_bytes_after: int
    file_bytes: int
    external_data: bool
    min_onnxruntime: str
    seconds: float = 0.0
    export_seconds: float | None = None
    warnings: list[str] = field(default_factory=list)
    accuracy_level: int | None = None  # of the MatMulNBits heads
    max_tensor_bytes: int | None = None  # the split limit asked for (None: no split)
    largest_initializer: int = 0  # bytes of the written graph's largest initializer

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        def mb(n: int) -> str:
            return f"{n / 2**20:.2f} MiB"
        lines = [f"{self.output}  (from {self.model}, overlay {self.overlay})"]
        for m in self.modules:
            q = "shared" if m.quantized_bytes == 0 else mb(m.quantized_bytes)
            lines.append(f"  {m.module:<28} {m.op:<21} {m.scheme:<14} block {m.block_size:<4} "
                         f"{mb(m.float_bytes):>12} -> {q:>12}  source: {m.source_check}")
            if m.parts:
                lines.append(f"    {len(m.parts)} parts{' (shared)' if m.quantized_bytes == 0 else ''}: "
                             + ", ".join(f"rows {p['rows'][0]}-{p['rows'][1]} ({mb(p['bytes'])})"
                                         for p in m.parts))
        lines.append(f"  initializers {mb(self.initializer_bytes_before)} -> "
                     f"{mb(self.initializer_bytes_after)}; file(s) {mb(self.file_bytes)}"
                     f"{' (external data)' if self.external_data else ''}; "
                     f"needs onnxruntime >= {self.min_onnxruntime}"
                     + ("" if self.accuracy_level is None else f"; MatMulNBits accuracy_level {self.accuracy_level}"))
        if self.max_tensor_bytes is not None:
            lines.append(f"  largest initializer {mb(self.largest_initializer)} "
                         f"(limit {mb(self.max_tensor_bytes)})")
        t = f"{self.seconds:.1f}s" if self.export_seconds is None else \
            f"{self.seconds:.1f}s (export {self.export_seconds:.1f}s)"
        lines.append(f"  done in {t}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
