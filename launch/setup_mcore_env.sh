#!/usr/bin/env bash
# A second virtual environment for the megatron-core compatibility tier: rlmega's own (.venv, megatron-core
# 0.16, the newest release for Python 3.11) underneath, and another supported megatron-core release on top,
# unpacked from its wheel. The later releases' wheels are tagged cp312 only for one C++ dataset helper rlmega
# does not use; every one of their Python files runs under 3.11, so the tier runs on the same Python.
#   bash launch/setup_mcore_env.sh 0.19        # -> .venv-mcore-0.19 (megatron-core 0.19.2)
#   RLMEGA_VENV=/path/to/base bash launch/setup_mcore_env.sh 0.17
# Prints the new environment's python on its last line. Needs the package index, or pip's cache of the wheels.
set -euo pipefail

usage="usage: bash launch/setup_mcore_env.sh 0.17|0.18|0.19 (0.16 is rlmega's own environment, launch/setup_env.sh)"
[ $# -eq 1 ] || { echo "$usage" >&2; exit 2; }
# The newest release of each supported megatron-core (rlmega/parallel/mcore_version.py: SUPPORTED).
case "$1" in
    0.17) version=0.17.1 ;;
    0.18) version=0.18.2 ;;
    0.19) version=0.19.2 ;;
    *) echo "megatron-core '$1' has no compatibility tier; $usage" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${RLMEGA_VENV:-$root/.venv}"
venv="$root/.venv-mcore-$1"
[ -x "$base/bin/python" ] || { echo "no environment at $base: run bash launch/setup_env.sh first" >&2; exit 2; }
pip=("$base/bin/python" -m pip --disable-pip-version-check)

if [ ! -f "$venv/megatron-core-$version" ]; then
    # Built beside and renamed into place: an interrupted build never passes for a finished one.
    rm -rf "$venv.partial" "$venv"
    "$base/bin/python" -m venv --without-pip "$venv.partial"
    site="$("$venv.partial/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    "${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --dest "$wheels" "megatron-core==$version"
    "$base/bin/python" -m zipfile -e "$wheels"/megatron_core-*.whl "$site"
    rm -f "$site"/megatron/core/datasets/helpers_cpp*.so  # built for CPython 3.12; rlmega reads no Megatron dataset
    # 0.18 and later import triton unconditionally (MoE paged stash); CUDA builds of torch bring it, the CPU build not.
    if [ "$1" != 0.17 ]; then
        "${pip[@]}" install --quiet --no-deps --target "$site" "triton>=3.3,<4"
    fi
    # rlmega's environment after this one's site-packages, with its .pth files (rlmega's editable install).
    base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    echo "import site; site.addsitedir('$base_site')" > "$site/zz_rlmega_base_environment.pth"
    touch "$venv.partial/megatron-core-$version"
    mv "$venv.partial" "$venv"
fi
"$venv/bin/python" -c "import megatron.core as m; assert m.__version__.split('+')[0] == '$version', m.__version__" 2>/dev/null || {
    echo "$venv does not import megatron-core $version; remove it and run this again" >&2; exit 1; }
echo "$venv/bin/python"
