#!/usr/bin/env bash
# The README's test command: install the pinned CPU torch first (an unpinned torch pulls a
# multi-GB CUDA build), then ckptool with its test extras, then run the default suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,test-mcore]'
python3 -m pytest -q "$@"
