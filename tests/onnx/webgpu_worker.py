"""Runs an ONNX graph on ONNX Runtime's WebGPU EP (or the CPU EP) in its own process.

Started by tests/onnx/webgpu.py with the environment of scripts/setup_webgpu.sh (Dawn
over SwiftShader): a crash or a hang of the renderer cannot take pytest with it.

    python webgpu_worker.py SPEC.json

SPEC: {"model", "inputs" (npz), "out" (npz), "ep": "webgpu"|"cpu", "ep_options": {},
"greedy": n (optional: n greedy steps of a no-KV-cache ``input_ids -> logits`` graph)}.
Prints one JSON line: {"placement": {node: [op, provider]}, "error": str|null,
"seconds": run time, "tokens": [...]}. Placement comes from ORT's own profile.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np


def session(model: str, ep: str, ep_options: dict, profile_prefix: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = profile_prefix
    so.log_severity_level = 3
    if ep == "webgpu":
        import onnxruntime_ep_webgpu as plugin
        ort.register_execution_provider_library("webgpu", plugin.get_library_path())
        devs = [d for d in ort.get_ep_devices() if d.ep_name == "WebGpuExecutionProvider"]
        if not devs:
            raise RuntimeError("no WebGPU EP device")
        so.add_provider_for_devices(devs, {k: str(v) for k, v in ep_options.items()})
        return ort.InferenceSession(model, sess_options=so)
    return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])


def placement(profile: str) -> dict:
    """node name -> [op type, execution provider], from the profile's kernel events."""
    out = {}
    with open(profile) as f:
        for ev in json.load(f):
            a = ev.get("args") or {}
            if ev.get("cat") == "Node" and "provider" in a:
                out[ev["name"].removesuffix("_kernel_time")] = [a.get("op_name"), a["provider"]]
    return out


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    feeds = dict(np.load(spec["inputs"]))
    res = {"placement": {}, "error": None, "seconds": None, "tokens": None}
    with tempfile.TemporaryDirectory() as tmp:
        sess = session(spec["model"], spec.get("ep", "webgpu"), spec.get("ep_options", {}),
                       os.path.join(tmp, "prof"))
        names = [o.name for o in sess.get_outputs()]
        t0 = time.perf_counter()
        try:
            outs = dict(zip(names, sess.run(None, feeds)))
            steps = spec.get("greedy", 0)
            if steps:
                ids, toks = feeds["input_ids"], []
                for _ in range(steps):
                    nxt = outs["logits"][:, -1].argmax(-1)[:, None].astype(ids.dtype)
                    toks.append(nxt[:, 0].tolist())
                    ids = np.concatenate([ids, nxt], 1)
                    outs = dict(zip(names, sess.run(None, {"input_ids": ids})))
                res["tokens"] = toks
            res["seconds"] = time.perf_counter() - t0
            np.savez(spec["out"], **outs)
        except Exception as e:  # the failure itself is what some tests check
            res["error"] = f"{type(e).__name__}: {e}"
        res["placement"] = placement(sess.end_profiling())
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
