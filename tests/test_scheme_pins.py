"""The overlay bytes of every scheme, pinned on fixed inputs.

Each case quantizes the same tiny untied checkpoint (embedding and head, values built
from integers, exact in bf16) and hashes ``embedq.safetensors`` and
``quantization_config.json``. The digests were recorded from the code before the scheme
unit (issue 31) and must not move: a refactor of the quantizers, packing or config writer
that changes a byte fails here. ``EMBEDQ_PIN_RECORD=1`` prints the table instead
(only for a deliberate format change, said in the commit).

RTN is elementwise IEEE arithmetic, the same on every CPU. ``mse`` and ``gptq`` sum
float errors: ATen's vectorized reductions add in an order set by the vector width of the
capability torch dispatches to (``default`` and ``avx2`` are both 8 float lanes, ``avx512``
16), and gptq's matmuls and Cholesky go through MKL, whose code path follows the CPU. So
their digests are pinned per torch CPU capability, and every capability this CPU can run is
checked in a subprocess with ``ATEN_CPU_CAPABILITY`` set and MKL held to the same branch
(``MKL_CBWR``): an AVX-512 machine checks the ``avx2`` and ``default`` pins too.
Record a capability's pins with ``EMBEDQ_PIN_RECORD=1 python tests/test_scheme_pins.py CAP``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import embedq

ROWS, COLS = 37, 128  # 37 rows: 4-bit zero points pad their last int32 word


def _table(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Integers in [-120, 120] from an LCG, times a power of two per row: exact in bf16."""
    s, vals = seed, []
    for _ in range(rows * cols):
        s = (s * 1103515245 + 12345) % (1 << 31)
        vals.append((s >> 8) % 241 - 120)
    t = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    t *= torch.tensor([2.0 ** (r % 5 - 8) for r in range(rows)]).unsqueeze(1)
    t[3] = 0                              # an all-zero row (scale 1)
    t[5, :32] = -t[5, :32].abs()          # a group whose extreme is negative (signed-max)
    t[6, :2] = torch.tensor([0.5, -0.5])  # a tie between the two extremes
    t[6, 2:32] = 0
    return t


def _calibration():
    from embedq.quant.gptq import Calibration
    a = torch.tensor([[((i * 7 + j * 3) % 11) - 5 for j in range(COLS)] for i in range(2 * COLS)],
                     dtype=torch.float64)
    return Calibration(hessian=a.t() @ a / a.shape[0])


def _case_id(c: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in c.items())


CASES = []
for _bits, _groups in ((8, (0, 32, 64, 128)), (4, (0, 32, 64))):
    for _g in _groups:
        for _sym in (True, False):
            CASES.append(dict(bits=_bits, group_size=_g, symmetric=_sym))
for _sd in ("float32", "float16"):
    for _bits, _g in ((8, 64), (8, 0), (4, 32)):
        for _sym in (True, False):
            CASES.append(dict(bits=_bits, group_size=_g, symmetric=_sym, scale_dtype=_sd))
FLOAT_CASES = []  # float-summing methods: pinned per torch CPU capability (module docstring)
for _m in ("mse", "gptq"):
    for _bits, _g, _sym in ((8, 64, True), (4, 32, True), (4, 32, False)):
        FLOAT_CASES.append(dict(bits=_bits, group_size=_g, symmetric=_sym, method=_m))
CASES.append(dict(bits=8, group_size=64, symmetric=True, source="float16"))
CASES.append(dict(bits=4, group_size=32, symmetric=False, source="float32"))

# Recorded with EMBEDQ_PIN_RECORD=1 from bc25cfb (before issue 31's refactor).
PINS: dict[str, str] = {
    'bits=8-group_size=0-symmetric=True': '43c0fed074ce154173ec03ff0eade365',
    'bits=8-group_size=0-symmetric=False': '5b64c81814e7d81ec625338e74d23a4c',
    'bits=8-group_size=32-symmetric=True': 'ffb59765e426a1ae01310f45f5662e88',
    'bits=8-group_size=32-symmetric=False': 'ecd323544c51577a798c1ef719e8a81b',
    'bits=8-group_size=64-symmetric=True': '2776f2e41ae6f1d9b1fc0c7233ca1876',
    'bits=8-group_size=64-symmetric=False': '1e8474b77c449a9844aa3f1630cd05ab',
    'bits=8-group_size=128-symmetric=True': '83c95e3915247e158139ad50e04a608d',
    'bits=8-group_size=128-symmetric=False': '96a705f355e2f66aef17b1b288dd3fcf',
    'bits=4-group_size=0-symmetric=True': '733d5d0990eaed1bc3a7ca137f921cac',
    'bits=4-group_size=0-symmetric=False': '2a2ab3a242f80b84f5c925d3deadc37a',
    'bits=4-group_size=32-symmetric=True': '7f0f3bed5a30a7e432a968145f868152',
    'bits=4-group_size=32-symmetric=False': '3087840881dd49a3d3f00e7e4a44f417',
    'bits=4-group_size=64-symmetric=True': '31284852a50a1d50f60b89de46c95cd7',
    'bits=4-group_size=64-symmetric=False': 'b51ab01282aeb2f07707786ba40db399',
    'bits=8-group_size=64-symmetric=True-scale_dtype=float32': '9989738ac9a5ca77b8ed363c4255bc7f',
    'bits=8-group_size=64-symmetric=False-scale_dtype=float32': '2636ebee5e7f3825325c58971a5aec04',
    'bits=8-group_size=0-symmetric=True-scale_dtype=float32': '9c7c57d0c1fa5ddf43bc7c8230439454',
    'bits=8-group_size=0-symmetric=False-scale_dtype=float32': '88f045034f7d5f3b6076de45079d11ef',
    'bits=4-group_size=32-symmetric=True-scale_dtype=float32': 'd317c8f214269c0f3a39457a9816188d',
    'bits=4-group_size=32-symmetric=False-scale_dtype=float32': '39482c66d9af4d13bfed8390a80acce4',
    'bits=8-group_size=64-symmetric=True-scale_dtype=float16': '55240ec8ba9d7817e1c9ea77fbff7857',
    'bits=8-group_size=64-symmetric=False-scale_dtype=float16': 'ad6394516617d4c790865dbba5ba31fc',
    'bits=8-group_size=0-symmetric=True-scale_dtype=float16': '15007d787095e2d8d62d134489f8ad49',
    'bits=8-group_size=0-symmetric=False-scale_dtype=float16': 'a8d5731b8b2a150504d02b7439030783',
    'bits=4-group_size=32-symmetric=True-scale_dtype=float16': '3f53979b8e2337acbba72c5a988ef032',
    'bits=4-group_size=32-symmetric=False-scale_dtype=float16': '92276434f085dd91dc2fda21702c89b7',
    'bits=8-group_size=64-symmetric=True-source=float16': '0393903fb674c3a98562c290ccd8a4e7',
    'bits=4-group_size=32-symmetric=False-source=float32': '707f300dc0df9cfe93ce65bfbda9f8c9',
}


# mse/gptq per torch capability (``ATEN_CPU_CAPABILITY``), with the MKL branch held to match.
# default and avx2 recorded on an AMD EPYC (Zen 3, AVX2): identical to each other (8 lanes
# both) and to the single-capability pins recorded before. avx512 recorded 2026-12-04 on an
# AMD EPYC with AVX-512 (Zen 4 class: avx512f/bw/vl/dq, avx512_bf16): identical to avx2's on
# these inputs (the 16-lane sums happened to round alike); kept per capability because MKL's
# AVX512 branch on an Intel CPU is not the one an AMD CPU runs.
CAPABILITIES = {  # capability -> (CPU flags it needs, MKL_CBWR branch)
    "default": (set(), "COMPATIBLE"),
    "avx2": ({"avx2", "fma"}, "AVX2"),
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "AVX512"),
}
_AVX2_PINS = {
        'bits=8-group_size=64-symmetric=True-method=mse': '1733cf07dd1def2073196e95667f5b21',
        'bits=4-group_size=32-symmetric=True-method=mse': 'f2f40195f509ecccad174f339ec0adab',
        'bits=4-group_size=32-symmetric=False-method=mse': 'd0b3065145e28b197b4c9e1a8a962eed',
        'bits=8-group_size=64-symmetric=True-method=gptq': 'dce961515fe15430883813d52af75e14',
        'bits=4-group_size=32-symmetric=True-method=gptq': 'afeed6946a796c5b7f59effe80bba446',
        'bits=4-group_size=32-symmetric=False-method=gptq': 'e5294ba2449f19491c49616e69c9abe8',
}
FLOAT_PINS: dict[str, dict[str, str]] = {
    "default": dict(_AVX2_PINS), "avx2": dict(_AVX2_PINS), "avx512": dict(_AVX2_PINS),
}


def _pristine(root: Path) -> dict[str, Path]:
    out = {}
    for src in ("bfloat16", "float16", "float32"):
        p = root / src
        p.mkdir()
        (p / "config.json").write_text(json.dumps({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": ROWS,
            "hidden_size": COLS, "tie_word_embeddings": False}))
        dt = getattr(torch, src)
        save_file({"model.embed_tokens.weight": _table(ROWS, COLS, 1).to(dt),
                   "lm_head.weight": _table(ROWS, COLS, 2).to(dt),
                   "model.norm.weight": torch.ones(COLS, dtype=dt)},
                  p / "model.safetensors", metadata={"format": "pt"})
        out[src] = p
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return _pristine(tmp_path_factory.mktemp("pins"))


def _digest(case: dict, pristine, tmp_path) -> str:
    c = dict(case)
    src = c.pop("source", "bfloat16")
    path = tmp_path / "ckpt"
    shutil.copytree(pristine[src], path)
    kw = {}
    if c.get("method") == "gptq":
        kw["calibration"] = _calibration()
    embedq.quantize(path, lm_head=True, progress=False, **c, **kw)
    h = hashlib.sha256()
    for name in ("embedq.safetensors", "quantization_config.json"):
        h.update((path / name).read_bytes())
    return h.hexdigest()[:32]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_overlay_bytes_pinned(case, pristine, tmp_path):
    key = _case_id(case)
    got = _digest(case, pristine, tmp_path)
    if os.environ.get("EMBEDQ_PIN_RECORD") == "1":
        print(f"PIN {key!r}: {got!r},")
        return
    assert got == PINS[key], f"overlay bytes of {key} changed"


def _float_digests() -> dict[str, str]:
    """The mse/gptq digests in this process (its ATEN_CPU_CAPABILITY / MKL_CBWR)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "src").mkdir()
        pristine = _pristine(Path(d) / "src")
        out = {}
        for i, c in enumerate(FLOAT_CASES):
            (Path(d) / str(i)).mkdir()
            out[_case_id(c)] = _digest(c, pristine, Path(d) / str(i))
        return out


def _cpu_lacks(flags: set[str]) -> set[str]:
    """Of ``flags``, those /proc/cpuinfo does not list (the real CPU, not EMBEDQ_CPU_FEATURES)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(flags)
    have = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return flags - have


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_float_method_bytes_pinned(capability):
    """mse/gptq digests under every torch capability this CPU can run (module docstring)."""
    needs, branch = CAPABILITIES[capability]
    if _cpu_lacks(needs):
        pytest.skip(f"this CPU lacks {sorted(_cpu_lacks(needs))} for ATEN_CPU_CAPABILITY={capability}")
    if capability not in FLOAT_PINS:
        pytest.skip(f"no {capability} pins recorded yet: EMBEDQ_PIN_RECORD=1 python tests/test_scheme_pins.py "
                    f"{capability} on a CPU with {sorted(needs)}, then add them to FLOAT_PINS")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, MKL_CBWR=branch)
    env.pop("EMBEDQ_PIN_RECORD", None)
    p = subprocess.run([sys.executable, __file__, capability], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got.pop("__capability__") == capability.upper()  # torch really dispatched to it
    changed = {k: v for k, v in got.items() if v != FLOAT_PINS[capability][k]}
    assert not changed, f"overlay bytes changed under ATEN_CPU_CAPABILITY={capability}: {sorted(changed)}"


def test_every_case_pinned():
    assert sorted(PINS) == sorted(_case_id(c) for c in CASES)
    for cap, pins in FLOAT_PINS.items():
        assert sorted(pins) == sorted(_case_id(c) for c in FLOAT_CASES), cap


if __name__ == "__main__":  # python tests/test_scheme_pins.py CAPABILITY: that capability's digests
    digests = _float_digests()
    if os.environ.get("EMBEDQ_PIN_RECORD") == "1":
        print(f"FLOAT_PINS[{sys.argv[1]!r}] = " + json.dumps(digests, indent=4))
    digests["__capability__"] = torch.backends.cpu.get_cpu_capability()
    print(json.dumps(digests))
