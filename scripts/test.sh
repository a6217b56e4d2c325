#!/usr/bin/env bash
# The README's test command: install the pinned CPU torch first (an unpinned torch pulls a
# multi-GB CUDA build), then ckptool with its test extras, then run the default suite. On an
# externally managed python3 (PEP 668) this happens in a virtual environment (scripts/_python.sh).
# Arguments go to pytest (e.g. `bash scripts/test.sh tests/test_api.py -k open`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
install_ckptool '[test,test-mcore]'
"$PY" -m pytest -q "$@"
