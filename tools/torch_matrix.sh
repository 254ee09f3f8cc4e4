#!/usr/bin/env bash
# Runs the whole test suite on one torch release, in a fresh venv of its own.
#
#   tools/torch_matrix.sh 2.11.0            # the floor of the supported range
#   tools/torch_matrix.sh 2.15.0 -x -k lora # extra arguments go to pytest
#
# The venv is .venv-torch-<version> (made anew each run). The test dependencies come
# pinned from constraints.txt, as in CI; only torch differs. Releases other than CI's pin
# (2.13.0, a CPU build) come from the package registry as CUDA builds (about 3 GB with
# their libraries); the suite runs on the CPU all the same.
# Where pip is capped by a constraint of the machine's own (/etc/xdg/pip on our machines
# caps torch at 2.14.1), lift it with TORCH_PIP_CONFIG=/dev/null (pip then reads no
# configuration file, for both installs here).
# Extra pip arguments for the torch install (a local wheel folder, say): TORCH_PIP_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/torch_matrix.sh TORCH_VERSION [pytest args...]}
shift
venv=".venv-torch-$version"
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
cfg=()
[ -n "${TORCH_PIP_CONFIG:-}" ] && cfg=(env "PIP_CONFIG_FILE=$TORCH_PIP_CONFIG")
# shellcheck disable=SC2086
"${cfg[@]}" pip install ${TORCH_PIP_ARGS:-} "torch==$version" -c constraints.txt
"${cfg[@]}" pip install -e ".[test]" -c constraints.txt
python -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__"
python -m pytest -q "$@"
