#!/usr/bin/env bash
# Install ONNX Runtime's WebGPU execution provider on a machine without a GPU, for
# embedq's WebGPU tests: Dawn runs over SwiftShader's Vulkan driver (a CPU renderer).
#
#   - PyPI onnxruntime-ep-webgpu (a plugin EP, no dependencies) with --no-deps into a plain
#     folder that callers put on PYTHONPATH in front of the main venv (whose onnxruntime,
#     >= 1.31, loads it); nothing in the main venv changes;
#   - Debian libvulkan1 (the Vulkan loader) and SwiftShader's ICD (libvk_swiftshader.so +
#     vk_swiftshader_icd.json, from chromium-common), downloaded with `apt-get download`
#     and unpacked with dpkg-deb -x: nothing is installed system-wide.
#     (Mesa's lavapipe is rejected by Dawn: shaderUniform*ArrayDynamicIndexing required.)
#
# Everything is cached under ${EMBEDQ_CACHE:-~/.cache/embedq}/webgpu; idempotent (marker).
# Prints the environment to use (sh `export` lines); the last line of stdout is the
# env file, `. "$(scripts/setup_webgpu.sh | tail -1)"`.
set -euo pipefail
EP_VERSION="${EMBEDQ_WEBGPU_EP_VERSION:-0.4.0}"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
ROOT="$CACHE/webgpu"
PY="${EMBEDQ_PYTHON:-${EMBEDQ_VENV:-$CACHE/venv}/bin/python}"
MARKER="$ROOT/.embedq-webgpu-$EP_VERSION.ok"
export PIP_DISABLE_PIP_VERSION_CHECK=1
log() { echo "[webgpu] $*" >&2; }

if [[ ! -f "$MARKER" ]]; then
    rm -rf "$ROOT"
    mkdir -p "$ROOT/site" "$ROOT/deb" "$ROOT/root"
    log "onnxruntime-ep-webgpu==$EP_VERSION -> $ROOT/site"
    "$PY" -m pip install -q --no-deps --target "$ROOT/site" "onnxruntime-ep-webgpu==$EP_VERSION" >&2
    log "apt-get download libvulkan1 chromium-common (unpacked, not installed)"
    # a fresh machine may have no apt lists yet, and scripts/setup_aarch64.sh may hold the
    # apt lock at the same moment: refresh the lists and retry a few times before failing
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    for try in 1 2 3 4 5; do
        (cd "$ROOT/deb" && apt-get download libvulkan1 chromium-common >&2 2>"$ROOT/deb/apt.log") && break
        [ "$try" = 5 ] && { cat "$ROOT/deb/apt.log" >&2; log "error: apt-get download failed 5 times"; exit 1; }
        log "apt-get download failed (try $try): refreshing the apt lists"
        $SUDO apt-get update -qq >&2 || sleep 15
    done
    for d in "$ROOT"/deb/*.deb; do dpkg-deb -x "$d" "$ROOT/root"; done
    # keep only what is used: the loader and SwiftShader (chromium-common is ~100 MB unpacked)
    mkdir -p "$ROOT/lib"
    cp -a "$ROOT"/root/usr/lib/x86_64-linux-gnu/libvulkan.so.1* "$ROOT/lib/"
    cp "$ROOT/root/usr/lib/chromium/libvk_swiftshader.so" "$ROOT/lib/"
    # the ICD json names the library relative to itself ("./libvk_swiftshader.so")
    sed 's#"library_path": *"[^"]*"#"library_path": "./libvk_swiftshader.so"#' \
        "$ROOT/root/usr/lib/chromium/vk_swiftshader_icd.json" > "$ROOT/lib/vk_swiftshader_icd.json"
    rm -rf "$ROOT/root" "$ROOT/deb"
    cat > "$ROOT/env.sh" <<ENV
export PYTHONPATH="$ROOT/site\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$ROOT/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export VK_ICD_FILENAMES="$ROOT/lib/vk_swiftshader_icd.json"
export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1
export EMBEDQ_WEBGPU_PYTHON="$PY"
ENV
    # the check: the plugin registers and offers a WebGPU device over SwiftShader
    (. "$ROOT/env.sh" && "$PY" - >&2 <<'PYEOF'
import onnxruntime as ort, onnxruntime_ep_webgpu as ep
ort.register_execution_provider_library("webgpu", ep.get_library_path())
devs = [d for d in ort.get_ep_devices() if d.ep_name == "WebGpuExecutionProvider"]
assert devs, "no WebGPU EP device (SwiftShader ICD not found?)"
print(f"[webgpu] onnxruntime {ort.__version__}, WebGPU EP device: {devs[0].device.vendor} "
      f"{dict(devs[0].device.metadata)}")
PYEOF
    )
    touch "$MARKER"
fi
cat "$ROOT/env.sh"
echo "$ROOT/env.sh"
