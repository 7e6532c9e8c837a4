#!/usr/bin/env bash
# Download, here (where the package registry is reachable), the wheels the GPU machine lacks:
# flashinfer-python 0.6.0 (7.5 MB; 0.7.4's wheel alone is 101 MB, over the 64 MiB that travel)
# and apache-tvm-ffi for Python 3.12, and gguf (the real model's file). Their other imports
# (nvidia-ml-py, einops, click, tabulate, requests, packaging, ninja, numpy, pyyaml, tqdm) are in
# the GPU image already. .whl/ is git-ignored: carry it.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python==0.6.0 apache-tvm-ffi==0.1.15.post2
# gguf (pure Python; its imports numpy, pyyaml, requests, tqdm are there): the real model's file
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
ls -la .whl
