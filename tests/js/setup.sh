#!/usr/bin/env bash
# node_modules for the transformers.js test, cached outside the repository:
#     ${EMBEDQ_CACHE:-~/.cache/embedq}/transformersjs/<hash of package.json + lock>/node_modules
# Exact versions: package.json pins @huggingface/transformers, package-lock.json the rest
# (npm ci). Idempotent (marker). Prints the folder holding node_modules on its last line.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
KEY=$( (cat "$HERE/package.json"; [[ ! -f "$HERE/package-lock.json" ]] || cat "$HERE/package-lock.json") | sha256sum | cut -c1-12)
DIR="$CACHE/transformersjs/$KEY"
# checked even when node_modules is cached: the test runs node on every call
command -v node >/dev/null || { echo "node not found (Debian: apt-get install nodejs npm)" >&2; exit 1; }
if [[ ! -f "$DIR/.embedq-ok" ]]; then
    rm -rf "$DIR"
    mkdir -p "$DIR"
    # onnxruntime-node's install script fetches its CUDA EP from nuget.org; the CPU binaries
    # are in the npm package itself
    export ONNXRUNTIME_NODE_INSTALL=skip
    cp "$HERE/package.json" "$DIR/"
    if [[ -f "$HERE/package-lock.json" ]]; then
        cp "$HERE/package-lock.json" "$DIR/"
        (cd "$DIR" && npm ci --no-audit --no-fund --loglevel=error >&2)
    else
        (cd "$DIR" && npm install --no-audit --no-fund --loglevel=error >&2)
    fi
    touch "$DIR/.embedq-ok"
fi
echo "$DIR"
