#!/usr/bin/env bash
# One H200 (or any one CUDA GPU), one run under 8 minutes: a hard budget of 440 s for the two
# Python scripts together (plus at most 10 s for a killed one to exit, and ~20 s of checks before
# them). Sections, most important first, with estimates on one H200:
#   gpu_bench.py (gets 440 - 170 s; writes $OUT/gpu_bench.json after every section):
#     mfu            ~60 s   gpt2-124m seq 1024 bf16 per-block compile: MFU and tokens/s, hand timer
#     mfu_lightning  ~40 s   the same through Trainer + MFUMonitor (Inductor cache warm from mfu)
#     fp8           ~150 s   gpt2-774m: bf16, float8 tensorwise, float8 rowwise (~50 s each, mostly
#                            compile): speedup, per-step losses and their max / mean gap
#   gpu_paths.py (gets what is left, at least 170 s; writes $OUT/gpu_paths.json after every section):
#     sac            ~30 s   attention forward kernels per block in backward (flash / cuDNN /
#                            efficient SDPA) for none / selective / full, memory and time
#     meta_init      ~20 s   meta build + sharded init through DTensor's RNG vs the eager build
#     cpu_offload    ~35 s   cpu_offload=True steps: losses vs no offload, GPU memory
#     async_save     ~35 s   async save (pinned staging): training stall vs sync save
#     init_broadcast ~15 s   real weights built in __init__ under fsdp2 (NCCL staging path)
#     plan_memory    ~25 s   gpt2-124m peak memory under fsdp2 vs `lightning-disttrain plan`
# Total ~410 s estimated. LDT_GPU_DEADLINE (exported below) lets each script skip, and name in its
# JSON, a section that no longer fits instead of being killed in it; the timeouts are the backstop.
#
#   bash benchmarks/gpu.sh              # on the GPU machine
#   bash benchmarks/gpu.sh --smoke      # here, on CPU: tiny shapes, every code path
#
# Exit status 0 only when both scripts ran every section without error. Needs torch, lightning,
# torchmetrics and torchao. The GPU image has all but torchao; bring it
# as a wheel in .whl/ (see /work/.library/device/README.md; torchao's wheel is cp310-abi3, so it
# installs on any Python >= 3.10), e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0
# and carry ".whl". Without torchao the fp8 section is skipped, the others still run.
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
smoke=()
if [[ " $* " == *" --smoke "* ]]; then
    smoke=(--smoke)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
fi
"$PY" -c "import torch, lightning; print('# torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
# Inductor's cache in the job's own /tmp: the second section reuses the first's kernels.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
# On CPU (--smoke) compiling alone takes minutes: a wider budget, so that every section runs.
BUDGET=${LDT_GPU_BUDGET:-$([[ ${#smoke[@]} -gt 0 ]] && echo 1800 || echo 440)} PATHS_RESERVE=170
start=$SECONDS
export LDT_GPU_DEADLINE=$(( $(date +%s) + BUDGET ))
rc_bench=0 rc_paths=0
timeout --signal=INT --kill-after=10 $(( BUDGET - PATHS_RESERVE )) \
    "$PY" benchmarks/gpu_bench.py --sections "${sections[@]}" --reserve "$PATHS_RESERVE" "$@" || rc_bench=$?
left=$(( BUDGET - (SECONDS - start) ))
echo "# gpu_bench.py: exit $rc_bench after $(( SECONDS - start )) s; ${left} s left for gpu_paths.py"
if (( left >= 20 )); then
    timeout --signal=INT --kill-after=10 "$left" "$PY" benchmarks/gpu_paths.py "${smoke[@]}" || rc_paths=$?
else
    echo "# gpu_paths.py: not started, only ${left} s left"; rc_paths=124
fi
echo "# gpu_paths.py: exit $rc_paths; total $(( SECONDS - start )) s"
(( rc_bench == 0 && rc_paths == 0 ))
