#!/usr/bin/env bash
# Wheels the device machine lacks, for its Python 3.12 on x86_64, into .whl/ (ignored by
# git): the H200 image (Python 3.12.3, jax 0.11.2 + CUDA 13 plugin, flax, orbax,
# transformers, torch) has none of grpcio-health-checking, grpcio-reflection and
# smg-grpc-proto, and reaches no registry. Run it here before a device call, then carry
# the folder:  run(command="bash benchmarks/gpu_kernels.sh", carry=[".whl"]).
# gpu_kernels.sh installs them offline (--no-index --no-deps): anything the image already
# has at another version stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl grpcio-health-checking grpcio-reflection "smg-grpc-proto>=0.4.28,<0.5" \
  pytest pluggy iniconfig hypothesis sortedcontainers attrs tqdm prometheus_client tokenizers
du -sh .whl && ls .whl
