"""Each route of _missing_kernels.py is still needed and still sufficient, on any CPU: the
CPU feature that makes vLLM reach for the kernel is forced on, so the check does not
depend on this machine having avx512_bf16 or AMX. Fails loudly either way: "no longer
needed" (drop the route) or "no longer sufficient" (vLLM now reaches the kernel elsewhere)."""

from __future__ import annotations

import inspect

import pytest
import torch

from _missing_kernels import ROUTES, as_shipped, without_missing_cpu_kernels

BY_KERNEL = {r.kernel: r for r in ROUTES}


@pytest.fixture(autouse=True)
def routed():
    from vllm.config import VllmConfig, set_current_vllm_config
    without_missing_cpu_kernels()
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize("kernel", list(BY_KERNEL))
def test_route_still_needed(kernel):
    r = BY_KERNEL[kernel]
    assert r.missing(), (f"this vLLM build now has torch.ops._C.{kernel}: the route for "
                         f"{r.vllm_file} is no longer needed, remove it from _missing_kernels.py")
    assert kernel in inspect.getsource(r.module()), (
        f"{r.vllm_file} no longer mentions {kernel}: the route is no longer needed")


def _linear_layer(n, k):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k).to(torch.bfloat16), requires_grad=False)
    layer.bias = None
    return layer


def test_amx_small_gemm(monkeypatch):
    from vllm.model_executor.layers import utils
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with as_shipped(), pytest.raises((AttributeError, RuntimeError), match="convert_weight_packed"):
        utils.dispatch_cpu_unquantized_gemm(_linear_layer(32, 64), remove_weight=False)
    layer = _linear_layer(32, 64)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None),
                               torch.nn.functional.linear(x, layer.weight))


def test_gdn_conv1d_prepack(monkeypatch):
    from vllm.model_executor.layers import utils
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)

    def conv():
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.randn(8, 1, 4).to(torch.bfloat16), requires_grad=False)
        return m
    with as_shipped(), pytest.raises((AttributeError, RuntimeError),
                                     match="causal_conv1d_weight_pack"):
        utils.dispatch_cpu_unquantized_gemm(conv(), remove_weight=False)
    layer = conv()
    w = layer.weight.clone()
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    assert torch.equal(layer.weight, w) and not hasattr(layer, "_cpu_unpacked_conv_weight")


def test_amx_int4_linear_repack(monkeypatch, builder, tmp_path):
    """A compressed-tensors W4A16 checkpoint (test_vllm_models.py's base-config test) on an
    AMX CPU: vLLM as shipped repacks for W4A8 with the missing op; routed, it loads."""
    import shutil

    from vllm import envs
    from vllm.model_executor.kernels.linear.mixed_precision import cpu

    import _harness
    from _harness import compress_linears_ct, load_model
    d = tmp_path / "ct"
    shutil.copytree(builder.pristine("qwen2"), d)
    compress_linears_ct(d)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with monkeypatch.context() as m:
        m.setattr(cpu, "envs", envs)  # this route undone (and not re-applied by load_model)
        m.setattr(_harness, "without_missing_cpu_kernels", lambda: None)
        with pytest.raises((AttributeError, RuntimeError), match="convert_weight_packed_scale_zp"):
            load_model(d)
    _, model = load_model(d)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.scheme).__name__ == "CompressedTensorsWNA16" and qkv.use_w4a8 is False


@pytest.mark.parametrize("cls_name, kernel, ref", [
    ("QuickGELU", "gelu_quick", lambda x: x * torch.sigmoid(1.702 * x)),
    ("NewGELU", "gelu_new", lambda x: 0.5 * x * (1.0 + torch.tanh(
        0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))),
])
def test_activation_built_without_its_op(cls_name, kernel, ref):
    from vllm.model_executor.layers import activation
    cls = getattr(activation, cls_name)
    with as_shipped(), pytest.raises((AttributeError, RuntimeError), match=kernel):
        cls()
    x = torch.randn(5, 16)
    torch.testing.assert_close(cls()(x), ref(x))  # CPU dispatch: vLLM's forward_native


def test_skip_of_a_founding_test_fails(tmp_path):
    """The _founding.py hook, run on a skipping test in a pytest of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "conftest.py").write_text("from _founding import pytest_runtest_makereport\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.founding\n"
        "def test_a():\n    pytest.skip('no kernel')\n"
        "@pytest.mark.founding\n"
        "@pytest.mark.skipif(True, reason='marked skip')\n"
        "def test_b():\n    pass\n"
        "def test_c():\n    pytest.skip('an ordinary skip')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout
    # the skip in the test body fails it; the skip mark (setup) errors it: neither passes
    assert "1 failed, 1 skipped, 1 error" in r.stdout, r.stdout
    for why in ("no kernel", "marked skip"):
        assert f"founding-case test may not skip (it fails the suite): Skipped: {why}" in r.stdout
