#!/usr/bin/env bash
# Installs what the launch tests run for real: Open MPI, MPICH, and shellcheck for the generated
# job scripts (Debian packages).
# Idempotent; a no-op when they are there. Without root or apt-get it only says what is missing,
# and the tests that need them skip with that reason (on CI they fail instead).
set -euo pipefail
need=()
command -v mpirun.openmpi >/dev/null || need+=(openmpi-bin)
command -v mpiexec.mpich >/dev/null || need+=(mpich)
command -v shellcheck >/dev/null || need+=(shellcheck)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: ${need[*]} not installed (needs root and apt-get); the MPI launch and shellcheck tests will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
