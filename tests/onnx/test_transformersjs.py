"""transformers.js (@huggingface/transformers 4.3.1, Node, onnxruntime-node) generates from an
embedq-patched optimum folder on local disk the greedy tokens onnxruntime Python does.

The folder layout transformers.js reads (docs/onnx.md): ``config.json``, the tokenizer files
and ``onnx/model<suffix>.onnx`` where the suffix names the ``dtype`` option: ``_int8`` for
``"int8"``, ``_q4`` for ``"q4"`` (``_quantized`` ``"q8"``, none ``"fp32"``). node_modules
come from tests/js/setup.sh (cached outside the repo, exact versions from package-lock.json).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import clients
import numpy as np
import pytest
import torch

from embedq.backends.onnx import patch_model
from onnxutil import run_decoder

JS = Path(__file__).resolve().parents[1] / "js"
KIND = "untied96-h32-v4k"  # untied: a tied random tiny model only repeats its last token
TEXT = "w17 w401 w4000 w1234 w99"
STEPS = 8


@pytest.fixture(scope="session")
def transformersjs(tmp_path_factory) -> Path:
    """A folder with generate.mjs beside the cached node_modules."""
    if shutil.which("node") is None:
        clients.unavailable("transformers.js", "node is not on PATH (Debian: apt-get install nodejs npm)")
    d = tmp_path_factory.mktemp("js")
    (d / "node_modules").symlink_to(Path(clients.setup("tests/js/setup.sh", "transformers.js")) / "node_modules")
    shutil.copy(JS / "generate.mjs", d)
    (d / "package.json").write_text('{"type": "module"}')
    return d / "generate.mjs"


@pytest.mark.parametrize("bits,group,dtype,split", [(8, None, "int8", None), (4, 32, "q4", 128 << 10)])
def test_transformersjs_greedy_equals_onnxruntime(transformersjs, optimum_model, overlay, checkpoints,
                                                  tmp_path, bits, group, dtype, split):
    src = optimum_model(KIND)
    root = tmp_path / "models"
    folder = root / "tiny"
    (folder / "onnx").mkdir(parents=True)
    for f in checkpoints(KIND).iterdir():  # config, generation config, tokenizer files (the
        if f.suffix == ".json":              # optimum folder has no tokenizer: it loads none here)
            shutil.copy(f, folder / f.name)
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    name = {"int8": "model_int8.onnx", "q4": "model_q4.onnx"}[dtype]
    r = patch_model(src, overlay(KIND, bits, group), folder / "onnx" / name, accuracy_level=0,
                    external_data=False, max_tensor_bytes=split)
    assert all(bool(m.parts) == (split is not None) for m in r.modules) and len(r.modules) == 2
    p = subprocess.run(["node", str(transformersjs), str(root), "tiny", dtype, TEXT, str(STEPS)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    js = json.loads(p.stdout.strip().splitlines()[-1])

    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert js["input_ids"] == ids
    _, toks, _ = run_decoder(folder / "onnx" / name, torch.tensor([ids]), steps=STEPS, head_dim=32)
    want = toks[0].tolist()
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    got = js["tokens"]
    # transformers.js stops at the end-of-sequence token; onnxruntime here does not
    assert got == want[:len(got)] and (len(got) == STEPS or got[-1] == eos), (got, want)
    assert len(got) >= 3 and len(set(got)) > 1, got
    print(f"\ntransformers.js {dtype}: {got}")
    assert np.all(np.array(got) >= 0)
