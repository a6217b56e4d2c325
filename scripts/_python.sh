# Sourced by scripts/demo.sh and scripts/test.sh (the README's two commands): picks the Python that
# installs and runs ckptool, and installs it there.
#
# python3 inside a virtual environment, or one pip may install into (no EXTERNALLY-MANAGED marker, as
# CI's pyenv python): that python3, exactly as before. An externally managed python3 outside a virtual
# environment (PEP 668: Debian 12's and Ubuntu 24.04's /usr/bin/python3, where pip refuses to install)
# gets a virtual environment instead: CKPTOOL_VENV, default .venv in the repository (ignored by git),
# created on first use and reused after; one line says which.
#
# Sets PY (the interpreter to run) and puts its scripts directory first on PATH (ckptool, torchrun);
# defines install_ckptool. The caller has cd'd to the repository root and set -euo pipefail.

say() { echo "ckptool: $*" >&2; }

# True when pip would refuse to install into this interpreter (PEP 668): its stdlib directory holds
# EXTERNALLY-MANAGED and it is not a virtual environment (pip ignores the marker inside one).
externally_managed() {
    "$1" -c 'import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if os.path.isfile(marker) and not in_venv else 1)'
}

# The virtual environment's python, created (or repaired) when it has no working pip. Debian splits
# venv's ensurepip into the python3-venv package; without it `python3 -m venv` leaves a half-made
# environment with no pip, so that case is told before anything is created.
venv_python() {
    local base=$1 venv=$2
    if "$venv/bin/python" -m pip --version > /dev/null 2>&1; then
        say "using the virtual environment $venv ($base is externally managed, PEP 668)"
    else
        if ! "$base" -c 'import ensurepip, venv' > /dev/null 2>&1; then
            say "$base is externally managed (PEP 668) and cannot create a virtual environment:" \
                "install its venv module (Debian/Ubuntu: apt-get install python3-venv), or run inside one"
            return 1
        fi
        say "creating the virtual environment $venv ($base is externally managed, PEP 668)"
        "$base" -m venv --clear "$venv" >&2
    fi
    echo "$venv/bin/python"
}

# Pinned CPU torch first (an unpinned torch pulls a multi-GB CUDA build), then ckptool, editable, with
# the extras given ("" or "[test,test-mcore]"). CKPTOOL_NO_INSTALL=1 skips both, for a python that has
# them already (the suite runs demo.sh so: a pip install there would move the environment's ckptool).
install_ckptool() {
    [ "${CKPTOOL_NO_INSTALL:-0}" = 1 ] && return
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e ".$1"
}

PY=python3
if externally_managed "$PY"; then
    CKPTOOL_VENV=${CKPTOOL_VENV:-.venv}
    case $CKPTOOL_VENV in /*) ;; *) CKPTOOL_VENV=$PWD/$CKPTOOL_VENV ;; esac
    PY=$(venv_python "$PY" "$CKPTOOL_VENV")
    export PATH="$CKPTOOL_VENV/bin:$PATH"
fi
