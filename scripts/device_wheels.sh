#!/usr/bin/env bash
# Fetches into .whl/ the wheels that scripts/gpu_check.py needs on the lent GPU machine and its
# image lacks, for CPython 3.12 on manylinux x86_64, then prints their total size and fails if
# it is over 60 MiB (the working tree that travels to that machine is capped at 64 MiB).
#
#   scripts/device_wheels.sh [--dry-run]
#
# The image has JAX 0.11 with its CUDA plugins, flax, optax, orbax, grpcio, msgpack, numpy,
# safetensors, tokenizers, huggingface_hub, transformers, torch, jinja2, tqdm, pyyaml and
# prometheus-client; the check's stages import none of fastapi, pydantic, uvicorn or
# llguidance. The engine builder imports the model loader, which imports gguf (pure Python;
# its own needs, numpy, pyyaml and tqdm, are in the image): that is the one wheel fetched.
# Install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# and put /tmp/site on PYTHONPATH. .whl/ is ignored by git; this script empties it first, so
# it never holds two versions of one package (that stops pip's install). It must not install
# anything here.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl"
max_mib=60
packages=(gguf==0.19.0)
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

platform_args=()
for p in "${platforms[@]}"; do
  platform_args+=(--platform "$p")
done
cmd=(python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp "${platform_args[@]}" -d "$dest" "${packages[@]}")

if [[ "${1:-}" == "--dry-run" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--dry-run]" >&2
  exit 2
fi

mkdir -p "$dest"
rm -f "$dest"/*.whl
"${cmd[@]}"

shopt -s nullglob
wheels=("$dest"/*.whl)
if [[ ${#wheels[@]} -eq 0 ]]; then
  echo "no wheels were fetched into $dest" >&2
  exit 1
fi
total=$(du -cb "${wheels[@]}" | tail -n 1 | cut -f 1)
for w in "${wheels[@]}"; do
  echo "$(du -b "$w" | cut -f 1) $(basename "$w")"
done
mib=$(awk -v t="$total" 'BEGIN { printf "%.2f", t / 1048576 }')
echo "total: $total bytes (${mib} MiB, limit ${max_mib} MiB) in ${#wheels[@]} wheels"
if (( total > max_mib * 1048576 )); then
  echo "the wheels exceed ${max_mib} MiB: the working tree could not travel" >&2
  exit 1
fi
