#!/usr/bin/env bash
# CI: Open MPI and mpi4py for the MPI test of tests/surfaces/test_distributed.py.  Best effort: any
# failure (no root, no network, no apt) prints why and exits 0, and the test then skips with
# its stated reason.  Run it inside the virtual environment the tests use (pip -> that env).
# Takes ~40 s on a Debian 12 machine (apt ~35 s, the mpi4py wheel ~5 s).
set -uo pipefail

log() { echo "install_mpi: $*"; }

if ! command -v mpirun >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        log "no apt-get: Open MPI not installed; the MPI test will skip"; exit 0
    fi
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            log "not root and no password-less sudo: the MPI test will skip"; exit 0
        fi
    fi
    if ! { $sudo apt-get update -qq &&
           $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
               --no-install-recommends openmpi-bin libopenmpi-dev; }; then
        log "apt-get install openmpi-bin libopenmpi-dev failed: the MPI test will skip"; exit 0
    fi
fi

if ! python -c "import mpi4py" 2>/dev/null; then
    python -m pip install --quiet "mpi4py>=3" || {
        log "pip install mpi4py failed: the MPI test will skip"; exit 0; }
fi
version="$(python -c 'import mpi4py; print(mpi4py.__version__)')"
log "$(mpirun --version 2>/dev/null | head -n 1); mpi4py $version"
