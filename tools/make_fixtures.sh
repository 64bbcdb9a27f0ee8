#!/usr/bin/env bash
# Regenerates the parity fixtures under tests/fixtures/ from the PyTorch reference (diffusers / transformers).
#
#   bash tools/make_fixtures.sh              # every generator
#   bash tools/make_fixtures.sh core attention   # only these (names of tools/fixtures/<name>.py)
#   bash tools/make_fixtures.sh --manifests  # key manifests of real configs (meta device, no weights)
#
# The reference lives in its own virtualenv (tools/.venv, git-ignored), created here with pip on first use:
# CPU torch, diffusers, transformers. Nothing here is needed to run the tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, diffusers, transformers" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet -r "$here/requirements.txt"
fi
export HF_HUB_OFFLINE=1
exec "$venv/bin/python" "$here/make_fixtures.py" "$@"
