"""Regenerate embedq/jobs/archfacts.json: per model class, what transformers states about
its embedding tables (see embedq/jobs/archfacts.py), for the installed transformers.

    python scripts/gen_archfacts.py          # minutes: imports every modeling module

Covers the classes of transformers' causal-LM, image-text-to-text and masked-LM auto
mappings that state their tied pair (``_tied_weights_keys``), and a few base encoders
(built on the meta device). Other classes are computed on first use and cached per user.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENCODERS = {"BertModel": "bert", "RobertaModel": "roberta", "XLMRobertaModel": "xlm-roberta",
            "MPNetModel": "mpnet", "DistilBertModel": "distilbert", "ModernBertModel": "modernbert",
            "NomicBertModel": "nomic_bert"}


def main() -> None:
    import transformers
    from transformers.models.auto import modeling_auto as ma

    from embedq.jobs import archfacts
    classes: dict[tuple[str, str], None] = {}
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        for mt, names in getattr(ma, mapping, {}).items():
            for n in (names if isinstance(names, (list, tuple)) else [names]):
                classes[(n, mt)] = None
    out: dict[str, dict] = {}
    t0 = time.time()
    for name, mt in sorted(classes):
        try:
            f = archfacts.compute_facts({"architectures": [name], "model_type": mt}, allow_skeleton=False)
        except Exception:
            f = None
        if f is not None:
            out[archfacts.class_key({"architectures": [name], "model_type": mt})] = f
    for name, mt in ENCODERS.items():
        if getattr(transformers, name, None) is None:
            continue
        f = archfacts.compute_facts({"architectures": [name], "model_type": mt}, allow_skeleton=True)
        if f is not None:
            out[archfacts.class_key({"architectures": [name], "model_type": mt})] = f
    doc = {"transformers": transformers.__version__, "generated_by": "scripts/gen_archfacts.py",
           "classes": out}
    archfacts.PACKAGED.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    print(f"{len(out)} of {len(classes) + len(ENCODERS)} classes in {time.time() - t0:.0f}s -> "
          f"{archfacts.PACKAGED}", file=sys.stderr)


if __name__ == "__main__":
    main()
