# Shared by the scripts/setup_*_venv.sh scripts (sourced, not run): one cached virtualenv
# per engine or peer, outside the repository, rebuilt from scratch unless complete.
#
#     venv_begin NAME VENV TAG    # sets PY, MARKER; logs as [NAME]
#     if venv_needs_build; then ...install the engine into $PY...; venv_built; fi
#     venv_install_embedq         # editable embedq beside the engine, nothing of it moved
#     echo "$PY"                  # the scripts print the venv's python on their last line

export PIP_DISABLE_PIP_VERSION_CHECK=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"

venv_begin() {
    _VENV_NAME="$1" VENV="$2" MARKER="$2/.embedq-$3.ok" PY="$2/bin/python"
}

log() { echo "[$_VENV_NAME] $*" >&2; }

# True (0) when the venv must be (re)built: no marker means no trust, so a half-built venv
# (a killed install) is removed and created afresh.
venv_needs_build() {
    if [[ -f "$MARKER" && -x "$PY" ]]; then
        log "reusing $VENV"
        return 1
    fi
    mkdir -p "$CACHE"
    if [[ -d "$VENV" ]]; then
        log "removing incomplete venv $VENV"
        rm -rf "$VENV"
    fi
    _VENV_START=$(date +%s)
    log "creating $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip >&2
}

venv_built() {
    touch "$MARKER"
    log "built in $(( $(date +%s) - _VENV_START ))s; venv size $(du -sh "$VENV" | cut -f1)"
}

# Every installed distribution as name==version (lower-case names; embedq itself left out).
_venv_pins() {
    "$PY" - <<'PYEOF'
import importlib.metadata as m
seen = {}
for d in m.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    if name and name != "embedq":
        seen[name] = d.version
print("\n".join(f"{k}=={v}" for k, v in seen.items()))
PYEOF
}


# embedq itself, editable, with its dependencies (+ pytest): every distribution already in
# the venv is held at its version (a constraint), so pip may only add packages. pyproject's
# ranges must admit the engine's versions: if they do not, pip fails here (and so does
# tests/vllm/test_vllm_install.py). Dependencies are resolved again only when
# pyproject.toml changes; otherwise only the (cheap) editable link is refreshed.
venv_install_embedq() {
    local stamp="$VENV/.embedq-deps.$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
    local before="$VENV/.embedq-pins.txt" out
    _venv_pins | LC_ALL=C sort > "$before"
    if [[ ! -f "$stamp" ]]; then
        log "installing embedq (editable) and its dependencies, the engine's versions held"
        out=$("$PY" -m pip install -q -c "$before" -e "$REPO" pytest 2>&1) || { echo "$out" >&2; return 1; }
        rm -f "$VENV"/.embedq-deps.*
        touch "$stamp"
    elif ! out=$("$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1); then
        out=$("$PY" -m pip install -q --no-deps -e "$REPO" 2>&1) || { echo "$out" >&2; return 1; }
    fi
    [[ -z "$out" ]] || echo "$out" >&2
    if grep -q "dependency resolver\|incompatible" <<<"$out"; then
        log "error: pip reports a dependency conflict installing embedq (above)"
        return 1
    fi
    local moved
    moved=$(LC_ALL=C comm -23 "$before" <(_venv_pins | LC_ALL=C sort))
    if [[ -n "$moved" ]]; then
        log "error: installing embedq moved the engine's packages: $(tr '\n' ' ' <<<"$moved")"
        return 1
    fi
}
