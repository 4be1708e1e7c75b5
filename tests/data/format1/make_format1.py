"""How tests/data/format1 was made: with the format-1 (sha256) code of commit 50ce402.

    git archive 50ce402 embedq | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old EMBEDQ_NO_TRANSFORMERS=1 python tests/data/format1/make_format1.py /tmp/f1

Stored from its output: base/{config.json,model.safetensors}, the in-place overlay's
files of inplace-int8/ (its shards are base's), the bundle's overlay and config.
"""
import json, shutil, sys
from pathlib import Path
import torch, transformers as tf
out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
torch.manual_seed(0)
cfg = tf.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
base = out / "base"
tf.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base)
import embedq
inplace = out / "inplace-int8"
shutil.copytree(base, inplace)
embedq.quantize(inplace, 8, progress=False)
embedq.quantize(base, 4, group_size=32, symmetric=False, output=out / "bundle-q4-g32-asym",
                overlay_only=True, progress=False)
q = json.loads((inplace / "quantization_config.json").read_text())
assert q["format_version"] == 1 and "sha256" in q["modules"]["model.embed_tokens"]["source"]
