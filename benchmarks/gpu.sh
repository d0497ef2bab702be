#!/usr/bin/env bash
# One GPU machine (1 to 8 CUDA GPUs), one run under 8 minutes: a hard budget of 440 s for the
# Python scripts together (plus at most 10 s for a killed one to exit, and ~20 s of checks before
# them). In this order:
#   gpu_versions.py (~5 s, not in the budget): torch / CUDA / NCCL / lightning / torchao here against
#                   the pins (torch==2.13.0 of .ci/run and the README; pyproject's specifiers);
#                   prints each difference, never fails; $OUT/gpu_versions.json
#   gpu_layouts.py  (only with 2+ GPUs; gets min(LDT_GPU_LAYOUTS_BUDGET=170 s, budget - 170 s)): every
#                   multi-rank layout with torchrun against a one-GPU run of the same model, seed and
#                   data: tp_setup [2] and offload_clip [2] (no-crash checks: both crashed on NCCL),
#                   tp [2], pp [2], ep [2], hsdp [4], float8_tp [2], async_tp [2], cp [2]:
#                   loss parity, gathered initial weights vs the eager one-GPU build, the layout
#                   applied; "skipped: <layout> needs N GPUs (have M)" for the others (see its
#                   docstring); $OUT/gpu_layouts.json. On one GPU it only prints the skips.
# and then, on one GPU, with estimates on one H200:
#   gpu_bench.py (gets what is left but 170 s; writes $OUT/gpu_bench.json after every section):
#     mfu            ~60 s   gpt2-124m seq 1024 bf16 per-block compile: MFU and tokens/s, hand timer
#     mfu_loss       ~50 s   the same with GPTModule's fp32 loss eager, then compiled: speedup, memory
#     mfu_lightning  ~40 s   the same through Trainer + MFUMonitor, blocks and loss compiled
#     fp8           ~150 s   gpt2-774m: bf16, float8 tensorwise, float8 rowwise (~50 s each, mostly
#                            compile): speedup, per-step losses and their max / mean gap
#     fp8_wide      ~120 s   the same on 4 blocks of Llama-3-8B's width (d 4096, SwiGLU 14336)
#   gpu_paths.py (gets what is left, at least 170 s; writes $OUT/gpu_paths.json after every section;
#                 every Trainer there is bf16-mixed with gradient_clip_val 1.0 and the fused AdamW,
#                 as the shipped configs run: a path the first GPU run never took):
#     sac            ~30 s   attention forward kernels per block in backward (flash / cuDNN /
#                            efficient SDPA) for none / selective / full, memory and time (eager)
#     sac_compiled   ~60 s   the same with each block compiled, flash only
#     meta_init      ~20 s   meta build + sharded init through DTensor's RNG vs the eager build
#     cpu_offload    ~35 s   cpu_offload=True steps: losses vs no offload, GPU memory
#     async_save     ~35 s   async save (pinned staging): training stall vs sync save
#     init_broadcast ~15 s   real weights built in __init__ under fsdp2 (NCCL staging path)
#     plan_memory    ~25 s   gpt2-124m peak memory under fsdp2 vs `lightning-disttrain plan`, per phase
#     plan_memory_llama ~30 s  the same for 4 blocks of Llama-3-8B (128k vocabulary)
#     plan_memory_llama_compiled ~45 s  the same with the strategy's compile option (blocks + loss)
#     memory_attribution[_llama] ~30 s each  what the forward keeps, by allocating source line
#     ring_attention ~40 s   context parallel's ring on one GPU (a thread per rank): the CUDA kernels
#                            with log-sum-exp (flash bf16 32k tokens GQA, head_dim 256; efficient fp32)
#                            vs one causal SDPA, forward and backward
# Total ~775 s estimated; measured on one H200 (2026-12-04): all parts 204 s before fp8_wide and
# sac_compiled, 303 s with them (every section passed), so the estimates are high. LDT_GPU_DEADLINE (exported below) lets each script skip, and name in its
# JSON, a section that no longer fits instead of being killed in it; the timeouts are the backstop.
#
# At the end gpu_report.py merges every JSON into $OUT/gpu_report.json (one file, every figure).
#
#   bash benchmarks/gpu.sh              # on the GPU machine
#   bash benchmarks/gpu.sh --smoke      # here, on CPU: tiny shapes, every code path (layouts: 2
#                                       # gloo processes per launch; hsdp and async_tp skipped)
#   bash benchmarks/gpu.sh --parts layouts        # only some parts: versions layouts bench paths
#   LDT_GPU_BUDGET=520 bash benchmarks/gpu.sh     # on 8 GPUs: room for the layouts and all the rest
#
# On a multi-GPU machine the layouts take their share of the 440 s first (correctness before
# figures), so gpu_bench.py's later sections may be skipped for time (named in its JSON): raise
# LDT_GPU_BUDGET (the device allows 600 s per command) or run `--parts layouts` and
# `--parts bench paths` as two commands.
#
# Exit status 0 only when every script that ran passed every section and check. Needs torch, lightning,
# torchmetrics, torchao and jsonargparse (the CLI, for `plan`). The device's image (seen 2026-12-04:
# torch 2.11.0+cu130, lightning 2.6.6) lacks torchao, jsonargparse, docstring-parser and
# typeshed-client; bring them as wheels in .whl/ (see /work/.library/device/README.md; torchao's
# wheel is cp310-abi3, so it installs on any Python >= 3.10), e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 jsonargparse==4.53.0 \
#       docstring-parser typeshed-client
# and carry ".whl" (4.4 MB). Without torchao the fp8 sections are skipped, the others still run.
# The whole run there took 204 s (2026-12-04 12:20 UTC), then 303 s with every section (17:35 UTC).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
export OUT=${OUT:-/tmp/ldt_gpu_out}
mkdir -p "$OUT"

smoke=() parts=(versions layouts bench paths) passthrough=()
while (( $# )); do
    case $1 in
        --smoke) smoke=(--smoke) ;;
        --parts) shift; IFS=', ' read -r -a parts <<< "$1" ;;
        --parts=*) IFS=', ' read -r -a parts <<< "${1#--parts=}" ;;
        *) passthrough+=("$1") ;;  # to gpu_bench.py (e.g. --no-compile)
    esac
    shift
done
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }

if ! "$PY" -c "import torchao, jsonargparse" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# 1. Versions first: what this machine runs against the pins (information: never fails).
if want versions; then
    "$PY" benchmarks/gpu_versions.py || echo "# gpu_versions.py failed (exit $?): versions not recorded"
fi
sections=(mfu mfu_loss mfu_lightning fp8 fp8_wide)
if ! "$PY" -c "import torchao.float8" 2>/dev/null; then
    echo "# torchao is not importable: skipping the fp8 section (see the header of $0)"
    sections=(mfu mfu_loss mfu_lightning)  # fp8 and fp8_wide need it
fi
if [[ ${#smoke[@]} -eq 0 ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
fi
"$PY" -c "import torch, lightning; print('# torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
# Inductor's cache in the job's own /tmp: the second section reuses the first's kernels.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
# On CPU (--smoke) compiling alone takes minutes: a wider budget, so that every section runs.
BUDGET=${LDT_GPU_BUDGET:-$([[ ${#smoke[@]} -gt 0 ]] && echo 1800 || echo 440)} PATHS_RESERVE=170
LAYOUTS_BUDGET=${LDT_GPU_LAYOUTS_BUDGET:-$([[ ${#smoke[@]} -gt 0 ]] && echo 900 || echo 170)}
start=$SECONDS
end=$(( $(date +%s) + BUDGET ))
rc_layouts=0 rc_bench=0 rc_paths=0

# 2. Multi-rank layouts (torchrun), when there are GPUs enough for any (2 CPU processes in --smoke).
if want layouts; then
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [[ ${#smoke[@]} -gt 0 ]] && gpus=2
    if (( gpus >= 2 )); then
        others=0; { want bench || want paths; } && others=$PATHS_RESERVE
        share=$(( BUDGET - others < LAYOUTS_BUDGET ? BUDGET - others : LAYOUTS_BUDGET ))
        LDT_GPU_DEADLINE=$(( $(date +%s) + share )) timeout --signal=INT --kill-after=10 $(( share + 30 )) \
            "$PY" benchmarks/gpu_layouts.py "${smoke[@]}" || rc_layouts=$?
        echo "# gpu_layouts.py: exit $rc_layouts after $(( SECONDS - start )) s (share ${share} s)"
    else
        # Prints "skipped: <layout> needs N GPUs (have M)" for each and records it in gpu_layouts.json.
        "$PY" benchmarks/gpu_layouts.py --gpus "$gpus" || rc_layouts=$?
    fi
fi
export LDT_GPU_DEADLINE=$end

# 3. One GPU: throughput (gpu_bench.py), then the CUDA-only paths (gpu_paths.py).
left=$(( end - $(date +%s) ))
if want bench; then
    reserve=0; want paths && reserve=$PATHS_RESERVE
    if (( left - reserve >= 20 )); then
        timeout --signal=INT --kill-after=10 $(( left - reserve )) \
            "$PY" benchmarks/gpu_bench.py --sections "${sections[@]}" --reserve "$reserve" "${smoke[@]}" \
            "${passthrough[@]}" || rc_bench=$?
    else
        echo "# gpu_bench.py: not started, only $(( left - reserve )) s left"; rc_bench=124
    fi
    echo "# gpu_bench.py: exit $rc_bench after $(( SECONDS - start )) s"
fi
left=$(( end - $(date +%s) ))
if want paths; then
    if (( left >= 20 )); then
        timeout --signal=INT --kill-after=10 "$left" "$PY" benchmarks/gpu_paths.py "${smoke[@]}" || rc_paths=$?
    else
        echo "# gpu_paths.py: not started, only ${left} s left"; rc_paths=124
    fi
    echo "# gpu_paths.py: exit $rc_paths; total $(( SECONDS - start )) s"
fi
"$PY" benchmarks/gpu_report.py --merge "$OUT"
echo "# every figure: $OUT/gpu_report.json"
(( rc_layouts == 0 && rc_bench == 0 && rc_paths == 0 ))
