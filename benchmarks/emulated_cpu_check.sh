#!/usr/bin/env bash
# Run a pytest selection on an emulated CPU (qemu user-mode), to check the engine's CPU fast paths on a kind of CPU
# this machine is not: e.g. an AVX2-only AMD EPYC (no AVX-512, so oneDNN cannot pack bf16 weights) from an AVX-512 box.
#
# Usage:  benchmarks/emulated_cpu_check.sh [-c CPU_MODEL] [-m MARCH] [-t TIMEOUT_S] [PYTEST_ARGS...]
#   -c CPU_MODEL  a qemu x86 CPU model (list: qemu-x86_64 -cpu help). Default EPYC-Rome (AVX2 + FMA, no AVX-512).
#                 Haswell is another AVX2 one; SandyBridge has AVX but no AVX2 (torch runs its DEFAULT kernels).
#                 Older models (Nehalem) die on SIGILL importing numpy 2.x, whose wheels need more than SSE4.2.
#   -m MARCH      ROLLOUT_KERNEL_MARCH for the C attention kernel. Default: from torch's CPU capability on the
#                 emulated CPU (AVX2 -> x86-64-v3, AVX512 -> x86-64-v4, else x86-64-v2). The compiler runs natively
#                 (qemu-user does not emulate child processes), so -march=native would target the host CPU; the
#                 engine refuses such a library (it checks the ISA against CPUID) and uses the PyTorch path.
#   -t TIMEOUT_S  wall-clock limit for the pytest run (default 1800).
#   PYTEST_ARGS   default: tests/engine/cpu/test_packed_linear.py tests/engine/cpu/test_cpu_features.py
#
# Example:  benchmarks/emulated_cpu_check.sh -c EPYC-Rome tests/rl/test_rollout_generator.py::test_bf16_copy_generates
#
# Needs qemu-user (Debian/Ubuntu: apt-get install qemu-user; qemu >= 7.2 for AVX2 emulation) and the project's
# virtualenv at .venv (or PYTHON=/path/to/python). Slow: importing torch takes ~7 s, a test module about a minute.
# The linear backends are timed on small weights there (ROLLOUT_LINEAR_PROBE_SHAPE, default 128x64): a test that
# compares those clocks with a real layer's expectations says nothing under emulation.
# Under qemu-user /proc/cpuinfo still shows the host CPU; torch (and the engine's detection) read CPUID instead.
# Kernel builds go to a fresh temporary ROLLOUT_KERNEL_CACHE, and torch.compile's to a fresh TORCHINDUCTOR_CACHE_DIR,
# both removed at the end; inductor's C++ is built for the same -march as the kernel (TORCHINDUCTOR_CPP_MARCH): its
# default, -march=native, is the host CPU here too. Without these, compiled engines under an emulated AVX2 CPU died of
# SIGILL (freshly compiled code) or generated only token 0 (code from the host's cache).
set -euo pipefail

cpu_model=EPYC-Rome
march=""
timeout_s=1800
while getopts "c:m:t:h" opt; do
    case "$opt" in
        c) cpu_model=$OPTARG ;;
        m) march=$OPTARG ;;
        t) timeout_s=$OPTARG ;;
        *) sed -n '2,21p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || set -- tests/engine/cpu/test_packed_linear.py tests/engine/cpu/test_cpu_features.py

cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if ! command -v qemu-x86_64 >/dev/null; then
    echo "qemu-x86_64 not found: install qemu-user (apt-get install qemu-user)" >&2
    exit 2
fi
if [ ! -x "$python" ]; then
    echo "no python at $python: create the virtualenv (.venv) or set PYTHON" >&2
    exit 2
fi

emulated() { qemu-x86_64 -cpu "$cpu_model" "$python" "$@" 2> >(grep -v "TCG doesn't support" >&2); }

capability=$(emulated -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
if [ -z "$march" ]; then
    case "$capability" in
        AVX512) march=x86-64-v4 ;;
        AVX2) march=x86-64-v3 ;;
        *) march=x86-64-v2 ;;
    esac
fi
echo "qemu -cpu $cpu_model: torch CPU capability $capability; ROLLOUT_KERNEL_MARCH=$march" >&2

cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
# the linear backends' probe on small weights: emulated clocks decide nothing real, and at full size each fresh
# detection spent minutes timing (tests re-detect often); the choices they feed still run
export ROLLOUT_KERNEL_CACHE=$cache TORCHINDUCTOR_CACHE_DIR=$cache/inductor ROLLOUT_KERNEL_MARCH=$march \
    TORCHINDUCTOR_CPP_MARCH=$march ROLLOUT_LINEAR_PROBE_SHAPE=${ROLLOUT_LINEAR_PROBE_SHAPE:-128x64} \
    WANDB_MODE=offline HF_HUB_OFFLINE=1
emulated -c "from rollout.engine.cpu.features import cpu_features; print(cpu_features().describe())" >&2
start=$SECONDS
status=0
timeout "$timeout_s" qemu-x86_64 -cpu "$cpu_model" "$python" -m pytest -q -p no:cacheprovider "$@" \
    2> >(grep -v "TCG doesn't support" >&2) || status=$?
echo "emulated run on $cpu_model took $((SECONDS - start)) s (exit status $status)" >&2
exit "$status"
