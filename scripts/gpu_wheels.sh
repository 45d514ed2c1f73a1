#!/usr/bin/env bash
# The wheels the GPU machine lacks (KINDS.md: no MONAI, nibabel or pycocotools there; Python 3.12, x86-64), for
# benchmarks/gpu_session.sh's NIfTI stages (the spleen data, configure) and COCO mAP: downloaded here into .whl/
# (ignored by git), then carried with run(carry=[".whl"]); gpu_session.sh installs them into /tmp/site.
#
#   bash scripts/gpu_wheels.sh            # about 10 MB, a minute; the versions below are this machine's
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo ""; }
for pkg in nibabel monai pycocotools; do
  v=$(ver "$pkg")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "$pkg${v:+==$v}"
done
ls -la .whl
