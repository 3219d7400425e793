#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels bench/gpu.sh needs on a GPU machine that has no network and whose
# image lacks them (this workplace's H200 image: Python 3.12, torch 2.11, transformers 5.17, no pydantic/gymnasium,
# no vLLM). They go to .whl/ (ignored by git; name it in the device tool's `carry`); about 15 MB.
#
#   bench/gpu/fetch-wheels.sh [DEST]          # default DEST: .whl (repository root)
#
# transformers and peft are pinned to the trainer's CPU versions (constraints-cpu.txt), which are inside vLLM 0.33.0's
# range (transformers >=5.16.1,<5.21). vLLM itself (and the torch 2.14 it pins) is far larger than the 64 MiB a device
# call can carry: gpu.sh uses vLLM only where the machine's image already has it (the trainer image), and otherwise
# falls back to the transformers engine and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" \
  transformers==5.20.2 peft==0.21.2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  gymnasium==1.4.0 farama-notifications==0.0.6
ls -la "$DEST"
