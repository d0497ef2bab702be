#!/usr/bin/env bash
# One H200 (or any one CUDA GPU): MFU of gpt2-124m at seq 1024 (bf16, per-block compile), the same
# through Trainer + MFUMonitor, and the float8 (tensorwise) speedup on gpt2-774m. About 4-6
# minutes; a hard stop at 470 s keeps it under 8. Prints a table; writes $OUT/gpu_bench.json
# (after every section) when $OUT is set.
#
#   bash benchmarks/gpu.sh              # on the GPU machine
#   bash benchmarks/gpu.sh --smoke      # here, on CPU: tiny shapes, every code path
#
# Needs torch, lightning, torchmetrics and torchao. The GPU image has all but torchao; bring it
# as a wheel in .whl/ (see /work/.library/device/README.md; torchao's wheel is cp310-abi3, so it
# installs on any Python >= 3.10), e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0
# and carry ".whl". Without torchao the fp8 section is skipped, the MFU sections still run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python

if ! "$PY" -c "import torchao" 2>/dev/null && compgen -G ".whl/torchao-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
sections=(mfu mfu_lightning fp8)
if ! "$PY" -c "import torchao.float8" 2>/dev/null; then
    echo "# torchao is not importable: skipping the fp8 section (see the header of $0)"
    sections=(mfu mfu_lightning)
fi
if [[ " $* " != *" --smoke "* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
fi
"$PY" -c "import torch, lightning; print('# torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
# Inductor's cache in the job's own /tmp: the second section reuses the first's kernels.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
exec timeout --signal=INT --kill-after=15 470 "$PY" benchmarks/gpu_bench.py --sections "${sections[@]}" "$@"
