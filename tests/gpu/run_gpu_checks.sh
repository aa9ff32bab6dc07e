#!/usr/bin/env bash
# The GPU checks, in two tiers, one PASS / FAIL / SKIP line per check.
#
#   --tier minimal  one CUDA GPU, no network: the Python that is there (torch, transformers, megatron-core,
#                   pytest; no Ray, vLLM, SGLang or transformer-engine). Megatron workers on CUDA in bf16,
#                   the bridge's export of CUDA tensors, the hf engine on CUDA, an in-process sync and the
#                   post-sync check. Installs nothing (but --wheels); about 6 minutes, each check bounded by
#                   --check-timeout. On a machine with no package index, bring megatron-core's wheel
#                   (tests/gpu/fetch_wheels.sh) and pass its folder with --wheels; with one wheel of each of
#                   several megatron-core releases there (--every-mcore), the tier runs once per release.
#   --tier cluster  a node with the GPU extras' wheels reachable: one virtual environment per extra (vLLM
#                   and SGLang pin different torch releases; transformer-engine compiles its torch extension
#                   on install, so it gets one of its own), each running its engine's and the worker's
#                   checks, then every other gpu-marked test there.
#
# Each check is a gpu-marked pytest test; its CPU contract twin runs everywhere (see tests/gpu/*.py).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash tests/gpu/run_gpu_checks.sh [--tier minimal|cluster] [--wheels DIR] [--check-timeout SECONDS] [--log FILE] [--only NAMES] [--list] [-- PYTEST_ARGS...]

  --tier minimal        (default) single GPU, air-gapped: runs with $PYTHON (default: python3), installs nothing
  --wheels DIR          minimal tier: first unpack DIR/*.whl (from tests/gpu/fetch_wheels.sh) into a temporary
                        folder ahead of $PYTHON's own packages, without an index or dependencies; several
                        megatron-core wheels there: every check runs with each of them in turn
  --tier cluster        per extra in $RLMEGA_GPU_EXTRAS (default: "vllm sglang gpu"): a venv
                        $RLMEGA_GPU_VENV_PREFIX-<extra> (default: .venv-gpu-<extra>), pip install -e .[test,<extra>]
  --check-timeout S     wall-clock limit of one check (default: 300)
  --log FILE            also write every check's whole pytest output to FILE (the console shows a failure's
                        last 40 lines)
  --only NAMES          run only these checks of the tier (comma-separated names from --list), e.g. to rerun
                        the ones that failed
  --list                print the checks of the tier and exit
  -h, --help            this text

Prints one line per check: PASS|FAIL|SKIP <check> (<seconds>s), then what the check measured (key=value, from
tests/gpu/measures.py), then a summary; exits 1 if any check failed (on the minimal tier, also if any was skipped).
EOF
}

tier=minimal
check_timeout=300
list_only=0
wheels=""
only=""
log_file=""
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tier) [ $# -ge 2 ] || { echo "--tier needs a value" >&2; usage >&2; exit 2; }; tier="$2"; shift 2 ;;
        --tier=*) tier="${1#--tier=}"; shift ;;
        --check-timeout) [ $# -ge 2 ] || { echo "--check-timeout needs a value" >&2; exit 2; }; check_timeout="$2"; shift 2 ;;
        --check-timeout=*) check_timeout="${1#--check-timeout=}"; shift ;;
        --wheels) [ $# -ge 2 ] || { echo "--wheels needs a folder" >&2; exit 2; }; wheels="$2"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        --log) [ $# -ge 2 ] || { echo "--log needs a file" >&2; exit 2; }; log_file="$2"; shift 2 ;;
        --log=*) log_file="${1#--log=}"; shift ;;
        --only) [ $# -ge 2 ] || { echo "--only needs check names" >&2; exit 2; }; only="$2"; shift 2 ;;
        --only=*) only="${1#--only=}"; shift ;;
        --list) list_only=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$tier" in minimal|cluster) ;; *) echo "--tier must be minimal or cluster, not '$tier'" >&2; exit 2 ;; esac
case "$check_timeout" in ''|*[!0-9]*) echo "--check-timeout must be a whole number of seconds" >&2; exit 2 ;; esac
if [ -n "$wheels" ]; then
    [ "$tier" = minimal ] || { echo "--wheels is for the minimal tier (the cluster tier installs from an index)" >&2; exit 2; }
    compgen -G "$wheels/*.whl" >/dev/null || {
        echo "--wheels: no .whl files in '$wheels' (make them with: bash tests/gpu/fetch_wheels.sh --dest $wheels)" >&2; exit 2; }
fi

if [ -n "$log_file" ]; then
    { : >"$log_file"; } 2>/dev/null || { echo "--log: cannot write '$log_file'" >&2; exit 2; }
    log_file="$(cd "$(dirname "$log_file")" && pwd)/$(basename "$log_file")"  # before the cd below
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

# check name -> pytest node ids (space-separated). A parametrized test named without its parameters runs them all;
# in one extra's environment the other engine's parameters skip, as do two-GPU ones on one GPU.
MINIMAL_CHECKS=(
    "worker-logprobs-vs-transformers|tests/gpu/test_worker_gpu.py::test_worker_logprobs_match_hf_on_gpu"
    "worker-bf16-update-vs-fp32-cpu|tests/gpu/test_minimal_tier.py::test_bf16_update_on_gpu_follows_the_fp32_cpu_update"
    "worker-packed-equals-padded|tests/gpu/test_worker_gpu.py::test_packed_update_equals_padded_on_gpu"
    "worker-response-row-logits|tests/gpu/test_worker_gpu.py::test_response_row_logits_update_equals_the_full_output_layer_on_gpu"
    "worker-offload-onload-bit-exact|tests/gpu/test_minimal_tier.py::test_offload_onload_is_bit_exact_on_gpu"
    "optimizer-offload-leaves-the-gpu|tests/gpu/test_minimal_tier.py::test_the_offloaded_optimizer_keeps_none_of_its_state_on_the_gpu_built_stepped_or_resumed"
    "distributed-optimizer-nccl-ws1|tests/gpu/test_minimal_tier.py::test_distributed_optimizer_over_nccl_equals_the_plain_one"
    "bridge-export-cuda-bf16|tests/gpu/test_minimal_tier.py::test_bridge_exports_cuda_bf16_tensors"
    "hf-engine-cuda-bf16|tests/gpu/test_minimal_tier.py::test_hf_engine_on_gpu_in_bf16"
    "sync-in-process-post-sync-check-bf16|tests/gpu/test_minimal_tier.py::test_in_process_sync_and_post_sync_check_in_bf16"
    "sync-shared-memory-cuda-ipc|tests/sync/test_gpu.py::test_shared_memory_moves_cuda_buckets_through_cuda_ipc"
)

engine_checks() {  # the checks of one extra's environment
    case "$1" in
        vllm|sglang) echo \
            "$1-greedy-and-logprobs-vs-hf|tests/gpu/test_$1_engine.py::test_greedy_and_logprobs_match_hf" \
            "$1-update-sleep-wake|tests/gpu/test_$1_engine.py::test_update_sleep_wake" \
            "$1-logprobs-vs-trainer|tests/gpu/test_engine_cluster.py::test_engine_logprobs_equal_the_trainer_after_sync" \
            "$1-sleep-sync-wake-memory|tests/gpu/test_engine_cluster.py::test_sleep_sync_wake_returns_memory_to_baseline[$1]" \
            "$1-grpo-three-steps|tests/gpu/test_trainer_gpu.py::test_three_grpo_steps_on_gpu" \
            "$1-update-drops-prefix-cache|tests/gpu/test_$1_engine.py::test_an_update_drops_the_prefix_cache_of_the_old_weights"
            [ "$1" = sglang ] || echo \
            "vllm-grpo-sharded-rdt|tests/gpu/test_trainer_gpu.py::test_three_grpo_steps_with_vllm_sharded_rdt" \
            "vllm-top-k-truncated-logprobs|tests/gpu/test_vllm_engine.py::test_top_k_logprobs_are_of_the_truncated_distribution" \
            "vllm-data-parallel-refused|tests/gpu/test_vllm_engine.py::test_data_parallel_is_refused" \
            "vllm-multimodal-with-tokenizer|tests/gpu/test_vllm_engine.py::test_a_multimodal_engine_starts_with_its_tokenizer" \
            "host-memcpy|tests/gpu/test_host_memcpy.py::test_host_memcpy_speed" ;;
        gpu) echo \
            "te-thd-partition|tests/gpu/test_context_parallel_te.py" \
            "te-lora-vs-merged-hf|tests/gpu/test_lora_te_gpu.py" \
            "te-worker-packed-equals-padded|tests/gpu/test_worker_gpu.py::test_packed_update_equals_padded_on_gpu" \
            "te-worker-response-row-logits|tests/gpu/test_worker_gpu.py::test_response_row_logits_update_equals_the_full_output_layer_on_gpu" \
            "sliced-refit-vs-plan|tests/gpu/test_sliced_refit.py::test_a_sliced_refit_matches_its_plan_on_gpus" ;;
        *) echo "unknown extra '$1' (choose from vllm sglang gpu)" >&2; return 2 ;;
    esac
}

passed=0; failed=0; skipped=0; failures=()

selected() {  # name: whether --only leaves this check in
    [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]
}

check_only() {  # the tier's check names, one per line: every --only name must be one of them
    local known="$1" name
    for name in ${only//,/ }; do
        grep -qxF -- "$name" <<<"$known" || {
            echo "--only: no check '$name' in tier $tier (see: bash tests/gpu/run_gpu_checks.sh --tier $tier --list)" >&2
            exit 2; }
    done
}

run_check() {  # python, "name|node ids"
    local python="$1" name="${2%%|*}" nodes="${2#*|}" log measures started elapsed rc
    selected "$name" || return 0
    log="$(mktemp)"; measures="$(mktemp)"
    started=$(date +%s)
    set +e -f  # -f: node ids such as test_x.py::test_y[vllm] are not globs
    # shellcheck disable=SC2086
    RLMEGA_GPU_MEASURES="$measures" timeout --kill-after=10 "$check_timeout" "$python" -m pytest \
        -p no:cacheprovider -q -rs -m gpu $nodes "${pytest_args[@]}" >"$log" 2>&1
    rc=$?
    set -e +f
    elapsed=$(( $(date +%s) - started ))
    local summary measured; summary="$(tail -n 1 "$log")"
    measured="$(paste -sd ' ' "$measures")"; measured="${measured:+: $measured}"
    if [ $rc -eq 0 ] && ! grep -q "passed" <<<"$summary"; then
        echo "SKIP $name (${elapsed}s): $(grep -m1 "^SKIPPED" "$log" || echo "$summary")"
        skipped=$((skipped + 1))
    elif [ $rc -eq 0 ]; then
        echo "PASS $name (${elapsed}s)$measured"
        passed=$((passed + 1))
    else
        [ $rc -eq 124 ] && summary="timed out after ${check_timeout}s"
        echo "FAIL $name (${elapsed}s): $summary${measured:+ (measured$measured)}"
        sed 's/^/    /' "$log" | tail -n 40
        failed=$((failed + 1)); failures+=("$name")
    fi
    [ -z "$log_file" ] || { echo "==== $name: $nodes"; cat "$log"; } >>"$log_file"
    rm -f "$log" "$measures"
}

use_wheels() {  # python [megatron-core wheel]: unpack the carried wheels, of several megatron-core ones the one
    # named, into a temporary folder that comes first on PYTHONPATH (ahead of the caller's own PYTHONPATH)
    [ -n "$wheels" ] || return 0
    local site wheel chosen=()
    for wheel in "$wheels"/*.whl; do
        case "${wheel##*/}" in megatron_core-*) [ -z "${2:-}" ] || [ "$wheel" = "$2" ] || continue ;; esac
        chosen+=("$wheel")
    done
    site="$(mktemp -d)"
    "$1" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" \
        "${chosen[@]}" || {
        echo "FAIL wheels: $1 could not install $wheels/*.whl (for another Python? make them with" \
            "tests/gpu/fetch_wheels.sh --python-version $("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'))"
        exit 1; }
    export PYTHONPATH="$site${caller_pythonpath:+:$caller_pythonpath}"
}

describe_environment() {  # python: one line of the versions the checks run with
    "$1" - 2>/dev/null <<'EOF' || echo "environment: $1 cannot import torch"
import platform
from importlib.metadata import PackageNotFoundError, version

def of(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"

import torch
gpu = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if torch.cuda.is_available() else "no CUDA device"
print(f"environment: Python {platform.python_version()}, torch {torch.__version__} ({gpu}), "
      f"transformers {of('transformers')}, megatron-core {of('megatron-core')}")
EOF
}

require_cuda() {
    "$1" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || {
        echo "FAIL cuda-visible: $1 sees no CUDA device"; exit 1; }
}

list_checks() {  # the tier's check names, one per line
    if [ "$tier" = minimal ]; then printf '%s\n' "${MINIMAL_CHECKS[@]%%|*}"; return; fi
    local extra check
    for extra in $extras; do for check in $(engine_checks "$extra"); do echo "${check%%|*}"; done; echo "$extra-all-gpu-tests"; done
}

extras="${RLMEGA_GPU_EXTRAS:-vllm sglang gpu}"
if [ $list_only -eq 1 ]; then list_checks; exit 0; fi
check_only "$(list_checks)"

if [ "$tier" = minimal ]; then
    python="${PYTHON:-python3}"
    caller_pythonpath="${PYTHONPATH:-}"
    # One pass with the carried wheels, or one per megatron-core release where several are carried (0.16 and 0.19).
    mcore_wheels=("")
    if [ -n "$wheels" ] && [ "$(compgen -G "$wheels/megatron_core-*.whl" | wc -l)" -gt 1 ]; then
        mapfile -t mcore_wheels < <(compgen -G "$wheels/megatron_core-*.whl" | sort -V)
    fi
    for mcore_wheel in "${mcore_wheels[@]}"; do
        use_wheels "$python" "$mcore_wheel"
        describe_environment "$python"
        require_cuda "$python"
        for check in "${MINIMAL_CHECKS[@]}"; do run_check "$python" "$check"; done
    done
else
    for extra in $extras; do
        checks="$(engine_checks "$extra")"
        wanted=0  # no venv for an extra that --only leaves without checks
        for check in $checks "$extra-all-gpu-tests|"; do selected "${check%%|*}" && wanted=1; done
        [ $wanted -eq 1 ] || continue
        venv="${RLMEGA_GPU_VENV_PREFIX:-$root/.venv-gpu}-$extra"
        [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
        "$venv/bin/python" -m pip install -q -e ".[test,$extra]"
        require_cuda "$venv/bin/python"
        for check in $checks; do run_check "$venv/bin/python" "$check"; done
        # Everything else that is gpu-marked; tests of packages not in this environment skip (importorskip).
        run_check "$venv/bin/python" "$extra-all-gpu-tests|tests"
    done
fi

echo "tier $tier: $passed passed, $failed failed, $skipped skipped${failures:+ (failed: ${failures[*]})}"
if [ $failed -gt 0 ]; then
    names="${failures[*]}"
    echo "rerun the failed checks with: --only ${names// /,}"
fi
# On the minimal tier every check must run: a skip there means the machine lacks what the tier promises.
[ $failed -eq 0 ] && { [ "$tier" = cluster ] || [ $skipped -eq 0 ]; }
