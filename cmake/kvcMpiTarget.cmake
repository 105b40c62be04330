# kvcMpiTarget.cmake -- the target kvc::mpi, written once for the build tree (the top
# CMakeLists.txt) and for the installed package (kvcConfig.cmake, find_package(kvc COMPONENTS mpi)).
# The caller has found MPI (find_package(MPI COMPONENTS CXX)).
#
# kvc::mpi = kvc::kvc + MPI::MPI_CXX: what <kvc/mpi.hpp> needs (MPI's C API, used from C++), and
# nothing else; kvc stays header-only (docs/distributed.md).

# kvc_set_mpi_usage(<target>): the usage requirements of kvc::mpi on an INTERFACE target.
function(kvc_set_mpi_usage target)
  target_link_libraries(${target} INTERFACE kvc::kvc MPI::MPI_CXX)
endfunction()
