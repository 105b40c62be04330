// kvc::runtime: the instantiations of include/kvc/detail/runtime_caches.hpp and
// runtime_instantiations.hpp for one element type, KVC_RUNTIME_ELEMENT, which
// cmake/kvcRuntimeTarget.cmake sets: this file is compiled once per element type, each into its
// own object, so that the four build in parallel.
#include <kvc/cache_description.hpp>
#include <kvc/runtime.hpp>

#ifndef KVC_RUNTIME_ELEMENT
#error "src/runtime.cpp is compiled by cmake/kvcRuntimeTarget.cmake, which defines KVC_RUNTIME_ELEMENT"
#endif

KVC_RUNTIME_CACHE_INSTANTIATIONS(, KVC_RUNTIME_ELEMENT)
KVC_RUNTIME_INSTANTIATIONS(, KVC_RUNTIME_ELEMENT)
