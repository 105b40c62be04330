# The headers of kvc in layers: a header may include headers of its own layer and of the layers
# below, never one above. Every header under include/, policies/ and concepts/ must be listed, so
# that a new one is placed on purpose. Run as
#   cmake -DROOT=<source dir> -P cmake/kvcCheckIncludeLayers.cmake
# (ctest: docs.include_layers). The layers, from the bottom:
#
#   0 base         standard headers (and nlohmann/json): errors, limits, warnings, the fp8 formats
#                  and element conversions, the row-code types, small traits, the paged bookkeeping (block manager,
#                  allocators, block tables, memory planner), the page and swap pools (templates
#                  over a storage policy) and the configuration structs
#   1 kinds        the layer kinds as tags, the config's layer-type table, ModelConfig and its JSON
#                  reader, GenerationConfig, the paged layer groups
#   2 views        the views (Eigen/Core) and the concepts over them
#   3 paged core   PagedCache and the scheduler: views, kinds and bookkeeping only
#   4 tensors      HostTensor (the Eigen Tensor module), the attention functions, the host storage,
#                  the codecs (row codes' tensor conversions too), the offload engines, paged attention
#   5 layer states each layer kind's state for a storage
#   6 caches       kvc::Cache, its ready-made forms, the type-erased AnyCache, PagedBatchCache
#   7 library      state save/load, MPI, export, make_cache, the runtime, <kvc/kvc.hpp>
#   8 device       the nvcc headers (.cuh) and <kvc/cuda.hpp>

set(kvc_layer_0
    detail/element_conversion.hpp detail/fixed_name.hpp detail/host_device.hpp detail/json.hpp
    detail/py_repr.hpp detail/row_code_types.hpp detail/simd.hpp detail/traits.hpp errors.hpp execution.hpp
    float8.hpp
    limits.hpp nvfp4.hpp rotation.hpp version.hpp warnings.hpp
    paged/allocators.hpp paged/attention_step.hpp paged/block_hash.hpp paged/block_manager.hpp
    paged/block_tables.hpp paged/continuous_batching_config.hpp paged/memory_planner.hpp
    paged/page_pools.hpp paged/request_keys.hpp paged/state_slots.hpp paged/swap_pool.hpp paged/undo_log.hpp
    policies/layers/crop_plan.hpp policies/offload/buffers.hpp policies/offload/none.hpp
    policies/offload/selection.hpp
    concepts/executor.hpp concepts/layer_policy.hpp concepts/offload_policy.hpp)
set(kvc_layer_1
    config.hpp config_json.hpp generation.hpp layer_types.hpp
    paged/continuous_batching_config_json.hpp paged/layer_groups.hpp
    policies/layers/kinds.hpp)
set(kvc_layer_2
    tensor_view.hpp detail/checked_state_view.hpp
    concepts/cache_layer.hpp concepts/linear_layer.hpp concepts/storage_policy.hpp)
set(kvc_layer_3
    paged/paged_cache.hpp paged/scheduler.hpp)
set(kvc_layer_4
    attention.hpp detail/attention_rows.hpp detail/state_io.hpp element_types.hpp
    fp8_attention.hpp quantized_attention.hpp row_codes.hpp tensor.hpp
    paged/paged_attention.hpp
    policies/offload/engine.hpp policies/offload/file.hpp policies/offload/pinned_host.hpp
    policies/quantization/codecs.hpp policies/storage/host.hpp)
set(kvc_layer_5
    policies/layers.hpp policies/layers/attention_part.hpp policies/layers/dynamic.hpp
    policies/layers/dynamic_indexed.hpp policies/layers/dynamic_sliding.hpp policies/layers/hybrid.hpp
    policies/layers/indexed.hpp policies/layers/indexed_parts.hpp policies/layers/kv_store.hpp
    policies/layers/linear.hpp policies/layers/quantized.hpp policies/layers/static.hpp
    policies/layers/static_indexed.hpp policies/layers/static_sliding.hpp)
set(kvc_layer_6
    any_cache.hpp cache.hpp cache_traits.hpp caches.hpp encoder_decoder_cache.hpp
    quantized_cache.hpp speculative_caches.hpp
    paged/paged_batch_cache.hpp)
set(kvc_layer_7
    cache_description.hpp detail/runtime_caches.hpp detail/runtime_instantiations.hpp export.hpp
    kvc.hpp make_cache.hpp mpi.hpp paged.hpp runtime.hpp state.hpp)
set(kvc_layer_8
    cuda.hpp detail/cuda_attention.cuh detail/cuda_kernels.cuh detail/cuda_row_codes.cuh detail/cuda_runtime.cuh
    policies/offload/host_engine.cuh policies/quantization/cuda_codecs.cuh
    policies/storage/cuda.cuh)

if(NOT ROOT)
  message(FATAL_ERROR "kvcCheckIncludeLayers: pass -DROOT=<source dir>")
endif()

foreach(layer RANGE 8)
  foreach(h IN LISTS kvc_layer_${layer})
    if(DEFINED kvc_rank_${h})
      message(FATAL_ERROR "kvcCheckIncludeLayers: ${h} is listed in two layers")
    endif()
    set(kvc_rank_${h} ${layer})
  endforeach()
endforeach()

# Every header, by the name it is included as (kvc/ stripped): include/kvc/X is X,
# policies/kvc/policies/X is policies/X, concepts/kvc/concepts/X is concepts/X.
set(kvc_errors "")
set(kvc_checked 0)
foreach(root IN ITEMS include policies concepts)
  file(GLOB_RECURSE files RELATIVE "${ROOT}/${root}/kvc" "${ROOT}/${root}/kvc/*.hpp" "${ROOT}/${root}/kvc/*.cuh")
  foreach(name IN LISTS files)
    math(EXPR kvc_checked "${kvc_checked} + 1")
    if(NOT DEFINED kvc_rank_${name})
      string(APPEND kvc_errors "  ${name} is in no layer: add it to cmake/kvcCheckIncludeLayers.cmake\n")
      continue()
    endif()
    set(own ${kvc_rank_${name}})
    file(STRINGS "${ROOT}/${root}/kvc/${name}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*<kvc/")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<kvc/([^>]+)>.*$" "\\1" target "${line}")
      if(NOT DEFINED kvc_rank_${target})
        string(APPEND kvc_errors "  ${name} includes <kvc/${target}>, which is in no layer\n")
      elseif(kvc_rank_${target} GREATER own)
        string(APPEND kvc_errors
               "  ${name} (layer ${own}) includes <kvc/${target}> (layer ${kvc_rank_${target}}), a layer above it\n")
      endif()
    endforeach()
  endforeach()
endforeach()

if(kvc_errors)
  message(FATAL_ERROR "kvcCheckIncludeLayers: headers break the layering:\n${kvc_errors}")
endif()
message(STATUS "kvcCheckIncludeLayers: ${kvc_checked} headers, each including only its own layer and those below")
