# Shared by scripts/test and scripts/demo: create .venv and install rdzv with the
# given extras plus torch==2.13.0 (the CPU build pip finds locally), once.
VENV="${RDZV_VENV:-$PWD/.venv}"
ensure_venv() {
  local extras="$1"
  local stamp="$VENV/.rdzv-installed-$extras"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[$extras]"
    touch "$stamp"
  fi
}
