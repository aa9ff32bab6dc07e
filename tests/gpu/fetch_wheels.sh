#!/usr/bin/env bash
# Wheels for the minimal GPU tier on a machine with no package index: run this where pip reaches one,
# copy the folder across, then `bash tests/gpu/run_gpu_checks.sh --wheels DIR` there.
#
# A GPU machine's image usually has torch, transformers, safetensors, numpy and pytest, not Megatron-Core:
# by default this fetches megatron-core in rlmega's own pinned range (read from setup.py), built for the
# GPU machine's Python; --every-mcore fetches the newest of each release rlmega tests (0.16 and 0.19, for
# Python 3.12), and run_gpu_checks.sh then runs the minimal tier once with each. Name any other requirement
# the machine lacks as NAME==VERSION.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash tests/gpu/fetch_wheels.sh [--python-version X.Y] [--dest DIR] [--every-mcore] [NAME==VERSION ...]

  --python-version X.Y  the GPU machine's Python (default: 3.12)
  --every-mcore         megatron-core 0.16.x and 0.19.x (the releases the CPU suites run on), not only the newest
  --dest DIR            where the wheels go (default: gpu-wheels)
  NAME==VERSION         more requirements to fetch (no dependencies are followed: name each one)
  -h, --help            this text

Fetches Linux x86-64 binary wheels only (no source builds), without their dependencies.
EOF
}

python_version=3.12
dest=gpu-wheels
every_mcore=0
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) [ $# -ge 2 ] || { echo "--python-version needs a value" >&2; exit 2; }; python_version="$2"; shift 2 ;;
        --dest) [ $# -ge 2 ] || { echo "--dest needs a value" >&2; exit 2; }; dest="$2"; shift 2 ;;
        --every-mcore) every_mcore=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) extra+=("$1"); shift ;;
    esac
done
case "$python_version" in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "--python-version must look like 3.12, not '$python_version'" >&2; exit 2 ;; esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python3}"
# megatron-core's range as setup.py states it, so the wheel is the one rlmega is tested with.
megatron="$("$python" - "$root/setup.py" <<'EOF'
import ast, sys
tree = ast.parse(open(sys.argv[1], encoding="utf-8").read())
for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "INSTALL_REQUIRES" for t in node.targets):
        print(next(r for r in ast.literal_eval(node.value) if r.startswith("megatron-core")))
EOF
)"
[ -n "$megatron" ] || { echo "setup.py names no megatron-core requirement" >&2; exit 1; }

platforms=()
for glibc in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${glibc}_x86_64"); done
mkdir -p "$dest"
fetch() {
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
        --python-version "$python_version" "${platforms[@]}" --platform manylinux2014_x86_64 --dest "$dest" "$@"
}
fetch "$megatron" "${extra[@]}"
if [ $every_mcore -eq 1 ]; then  # one pip call per release: in one call pip would pick a single megatron-core
    fetch "megatron-core==0.16.*"
fi
echo "wheels for Python $python_version in $dest:"
ls -1 "$dest"/*.whl | sed 's/^/  /'
echo "on the GPU machine: bash tests/gpu/run_gpu_checks.sh --wheels $dest"
