# kvcRuntimeTarget.cmake -- the target kvc::runtime, written once for the build tree (the top
# CMakeLists.txt) and for the installed package (kvcConfig.cmake, find_package(kvc COMPONENTS
# runtime)).
#
# kvc::runtime = kvc::kvc + a static library that holds the string/JSON runtime's instantiations
# (make_cache, make_encoder_decoder_cache, prepare_cache_for_generation and its encoder-decoder
# twin, cache_from_description's caches, AnyCache's models of the caches they build) for float,
# double, Eigen::half and Eigen::bfloat16, and KVC_RUNTIME_LIBRARY, which turns them into extern
# templates in every translation unit that links it (include/kvc/detail/runtime_instantiations.hpp).
# kvc stays header-only: the library is compiled from src/runtime.cpp in the consumer's own build,
# with its flags, once per element type (one object each, so they build in parallel).

# kvc_add_runtime_library(<target> <runtime.cpp>): defines <target> and the alias kvc::runtime.
# The element list is the one of KVC_ELEMENT_TYPES (include/kvc/element_types.hpp).
function(kvc_add_runtime_library target source)
  set(objects)
  set(object_targets)
  foreach(element float double half bfloat16)
    set(type ${element})
    if(element STREQUAL "half" OR element STREQUAL "bfloat16")
      set(type "Eigen::${element}")
    endif()
    add_library(${target}_${element} OBJECT EXCLUDE_FROM_ALL "${source}")
    target_link_libraries(${target}_${element} PRIVATE kvc::kvc)
    target_compile_definitions(${target}_${element} PRIVATE "KVC_RUNTIME_ELEMENT=${type}" KVC_RUNTIME_LIBRARY)
    list(APPEND objects $<TARGET_OBJECTS:${target}_${element}>)
    list(APPEND object_targets ${target}_${element})
  endforeach()
  add_library(${target} STATIC EXCLUDE_FROM_ALL ${objects})
  target_link_libraries(${target} PUBLIC kvc::kvc)
  target_compile_definitions(${target} PUBLIC KVC_RUNTIME_LIBRARY)
  # The object targets, for callers that set their flags (the element list is written only here).
  set_property(TARGET ${target} PROPERTY KVC_RUNTIME_OBJECT_TARGETS ${object_targets})
  add_library(kvc::runtime ALIAS ${target})
endfunction()
