#!/bin/sh
# Runs an MPI program on this machine for CTest (examples/CMakeLists.txt, label mpi):
#   sh run_mpi.sh <mpiexec> <ranks> <program> [arguments...]
# Exits 77 (the tests' SKIP_RETURN_CODE) when <mpiexec> is empty or cannot be run. With Open MPI it
# adds --oversubscribe (more ranks than cores is fine for a test) and, when running as root,
# --allow-run-as-root (CI containers run as root; Open MPI refuses it otherwise).
mpiexec=$1
ranks=$2
shift 2
case $mpiexec in
  "" | *-NOTFOUND) found= ;;
  *) found=$(command -v "$mpiexec" 2>/dev/null) ;;
esac
if [ -z "$found" ]; then
  echo "SKIPPED: mpirun not found (apt-get install openmpi-bin, or pass -DMPIEXEC_EXECUTABLE=...)"
  exit 77
fi
set --  -np "$ranks" "$@"
if "$mpiexec" --version 2>/dev/null | grep -Eq "Open MPI|OpenRTE|open-mpi"; then
  if [ "$(id -u)" = 0 ]; then
    set -- --allow-run-as-root "$@"
  fi
  set -- --oversubscribe "$@"
fi
exec "$mpiexec" "$@"
