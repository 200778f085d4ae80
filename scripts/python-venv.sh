#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create, or reuse, the Python virtual environment of suite `python`: torch 2.15 from PyPI
# with its nvidia-* dependencies (about 5 GB; without them `import torch` fails), numpy and
# safetensors. The mfsdp package itself is not installed into it: the tests put python/ on
# PYTHONPATH, so one venv serves every checkout.
#
#   scripts/python-venv.sh            prints the venv's python on the last line of stdout
#
# MFSDP_VENV (default ~/.cache/mfsdp/venv) is the venv; MFSDP_PYTHON (default python3) the
# interpreter that creates it. A venv whose torch is not 2.15 is refused, never modified.
# Exit status 1, with the reason on stderr, when it cannot be created: test.sh then fails
# the suite loudly (CI must not skip it silently).
set -euo pipefail

venv=${MFSDP_VENV:-$HOME/.cache/mfsdp/venv}
python=${MFSDP_PYTHON:-python3}
torch_spec='torch==2.15.*'

ready() {
  "$venv/bin/python" - <<'PY' 2>/dev/null
import sys
import numpy, safetensors, torch
sys.exit(0 if torch.__version__.startswith("2.15.") else 3)
PY
}

if [ -x "$venv/bin/python" ]; then
  if ready; then
    echo "$venv/bin/python"
    exit 0
  fi
  if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    v=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    case $v in
      2.15.*) ;;
      *) echo "python-venv: $venv has torch $v, not 2.15; remove it or set MFSDP_VENV" >&2
         exit 1 ;;
    esac
  fi
  echo "python-venv: completing $venv" >&2
else
  if ! command -v "$python" >/dev/null 2>&1; then
    echo "python-venv: no $python to create $venv with (set MFSDP_PYTHON)" >&2
    exit 1
  fi
  echo "python-venv: creating $venv (torch with its CUDA wheels, about 5 GB)" >&2
  mkdir -p "$(dirname "$venv")"
  if ! "$python" -m venv "$venv" >&2; then
    echo "python-venv: '$python -m venv' failed (Debian: apt-get install python3-venv)" >&2
    exit 1
  fi
fi
start=$(date +%s)
if ! "$venv/bin/pip" install -q "$torch_spec" numpy safetensors >&2; then
  echo "python-venv: pip install $torch_spec numpy safetensors failed" >&2
  exit 1
fi
if ! ready; then
  echo "python-venv: $venv was installed but 'import torch' (2.15) still fails" >&2
  exit 1
fi
echo "python-venv: ready in $(( $(date +%s) - start )) s" >&2
echo "$venv/bin/python"
