# lockstep's dependencies, found the same way in the source tree and in an installed package.
#
# Sets LOCKSTEP_CUDA_FOUND when the CUDA toolkit (with cuBLAS and NCCL) is usable, and defines the imported
# targets lockstep::openblas, lockstep::nccl (with CUDA) and lockstep::mpi_c (when MPI is found).
include_guard(GLOBAL)
include(CMakeFindDependencyMacro)

# In an installed package's config, a missing dependency makes find_package(lockstep) report NOT FOUND;
# in lockstep's own build it is an error.
macro(lockstep_find_required)
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "lockstep")
    find_dependency(${ARGN})
  else()
    find_package(${ARGN} REQUIRED)
  endif()
endmacro()

lockstep_find_required(Threads)
lockstep_find_required(ZLIB)

# OpenBLAS: Debian's libopenblas-dev ships an OpenBLASConfig.cmake that sets variables, not a target.
if(NOT TARGET lockstep::openblas)
  find_package(OpenBLAS CONFIG QUIET)
  if(NOT OpenBLAS_FOUND)
    find_path(OpenBLAS_INCLUDE_DIRS cblas.h PATH_SUFFIXES openblas openblas-pthread x86_64-linux-gnu/openblas-pthread)
    find_library(OpenBLAS_LIBRARIES openblas PATH_SUFFIXES openblas-pthread)
  endif()
  if(NOT OpenBLAS_INCLUDE_DIRS OR NOT OpenBLAS_LIBRARIES)
    message(FATAL_ERROR "lockstep needs OpenBLAS for host GEMM: install Debian's libopenblas-dev "
                        "(scripts/setup.sh does) or point CMAKE_PREFIX_PATH at an OpenBLAS install.")
  endif()
  add_library(lockstep::openblas INTERFACE IMPORTED)
  set_target_properties(lockstep::openblas PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "${OpenBLAS_LIBRARIES}")
endif()

# oneDNN (Debian's libdnnl-dev): optional. Where it is found, host GEMMs run on it as the table in
# blas/host_kernels.hpp says (it generates kernels for the CPU's instruction sets: AVX2, AVX-512, AVX512-BF16, AMX),
# and lockstep::lockstep carries LOCKSTEP_HAS_ONEDNN=1. LOCKSTEP_ONEDNN=OFF builds without it (OpenBLAS alone).
if(NOT DEFINED LOCKSTEP_ONEDNN)
  set(LOCKSTEP_ONEDNN AUTO)
endif()
if(NOT TARGET lockstep::onednn AND NOT LOCKSTEP_ONEDNN STREQUAL "OFF")
  # By its header and library, not its dnnl-config.cmake: Debian's asks for OpenCL's development files (its GPU
  # engine), which host GEMMs do not need.
  find_path(lockstep_onednn_include_dir oneapi/dnnl/dnnl.h)
  find_library(lockstep_onednn_library dnnl)
  # lockstep uses oneDNN 2.x's C API (operation descriptors), which oneDNN 3 removed.
  set(lockstep_onednn_major "")
  if(lockstep_onednn_include_dir AND EXISTS "${lockstep_onednn_include_dir}/oneapi/dnnl/dnnl_version.h")
    file(STRINGS "${lockstep_onednn_include_dir}/oneapi/dnnl/dnnl_version.h" lockstep_onednn_major_line
         REGEX "^#define DNNL_VERSION_MAJOR [0-9]+")
    string(REGEX REPLACE "^#define DNNL_VERSION_MAJOR ([0-9]+).*" "\\1" lockstep_onednn_major "${lockstep_onednn_major_line}")
  endif()
  if(lockstep_onednn_include_dir AND lockstep_onednn_library AND NOT lockstep_onednn_major STREQUAL "2")
    if(LOCKSTEP_ONEDNN STREQUAL "ON")
      message(FATAL_ERROR "LOCKSTEP_ONEDNN=ON but the oneDNN found (${lockstep_onednn_include_dir}) is version "
                          "'${lockstep_onednn_major}', and lockstep needs 2.x (Debian 12's libdnnl-dev)")
    endif()
    message(STATUS "lockstep: oneDNN ${lockstep_onednn_major} found, but lockstep needs 2.x: host GEMMs run on OpenBLAS")
  elseif(lockstep_onednn_include_dir AND lockstep_onednn_library)
    add_library(lockstep::onednn INTERFACE IMPORTED)
    set_target_properties(lockstep::onednn PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${lockstep_onednn_include_dir}"
      INTERFACE_LINK_LIBRARIES "${lockstep_onednn_library}"
      INTERFACE_COMPILE_DEFINITIONS LOCKSTEP_HAS_ONEDNN=1)
  elseif(LOCKSTEP_ONEDNN STREQUAL "ON")
    message(FATAL_ERROR "LOCKSTEP_ONEDNN=ON but oneDNN was not found: install Debian's libdnnl-dev "
                        "(scripts/setup.sh does) or point CMAKE_PREFIX_PATH at a oneDNN install")
  else()
    message(STATUS "lockstep: oneDNN not found: host GEMMs run on OpenBLAS alone (install libdnnl-dev for "
                   "kernels chosen by the CPU's instruction sets and bf16 on AVX512-BF16 / AMX)")
  endif()
endif()

# xxHash: io/checkpoint.hpp uses it as header-only code (XXH_INLINE_ALL), so only the header is needed.
if(NOT TARGET lockstep::xxhash)
  find_path(lockstep_xxhash_include_dir xxhash.h)
  if(NOT lockstep_xxhash_include_dir)
    message(FATAL_ERROR "lockstep needs xxhash.h for checkpoint checksums: install Debian's libxxhash-dev "
                        "(scripts/setup.sh does) or point CMAKE_PREFIX_PATH at an xxHash install.")
  endif()
  add_library(lockstep::xxhash INTERFACE IMPORTED)
  set_target_properties(lockstep::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${lockstep_xxhash_include_dir}")
endif()

# lockstep_enable_cuda(): turns on the CUDA language for a project that wants lockstep's CUDA backend: nvcc
# from /usr/local/cuda when none is configured, sm_80 and sm_90 unless CMAKE_CUDA_ARCHITECTURES is set, and
# C++20 for CUDA sources. Sets lockstep_CUDA_LANGUAGE to TRUE when it could. CMake < 3.25.2 does not know
# nvcc's -std=c++20 (its CUDA20 dialect table is empty); it is taught here.
macro(lockstep_enable_cuda)
  set(lockstep_CUDA_LANGUAGE FALSE)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    if(NOT CMAKE_CUDA_HOST_COMPILER AND CMAKE_CXX_COMPILER)
      set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    endif()
    enable_language(CUDA)
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    set(lockstep_CUDA_LANGUAGE TRUE)
  endif()
endmacro()

# CUDA toolkit, cuBLAS and NCCL: optional. Without them lockstep is the host backend alone.
set(LOCKSTEP_CUDA_FOUND FALSE)
if(NOT LOCKSTEP_CUDA STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND TARGET CUDA::cudart AND TARGET CUDA::cublas)
    find_path(LOCKSTEP_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(LOCKSTEP_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(LOCKSTEP_NCCL_INCLUDE_DIR AND LOCKSTEP_NCCL_LIBRARY)
      if(NOT TARGET lockstep::nccl)
        add_library(lockstep::nccl INTERFACE IMPORTED)
        set_target_properties(lockstep::nccl PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${LOCKSTEP_NCCL_INCLUDE_DIR}"
          INTERFACE_LINK_LIBRARIES "${LOCKSTEP_NCCL_LIBRARY}")
      endif()
      set(LOCKSTEP_CUDA_FOUND TRUE)
    elseif(LOCKSTEP_CUDA STREQUAL "ON")
      message(FATAL_ERROR "LOCKSTEP_CUDA=ON but NCCL (nccl.h, libnccl) was not found next to the CUDA toolkit")
    endif()
  elseif(LOCKSTEP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "LOCKSTEP_CUDA=ON but the CUDA toolkit (with cuBLAS) was not found")
  endif()
endif()

# MPI (OpenMPI) for multi-process runs: optional; lockstep::mpi links it.
if(NOT TARGET lockstep::mpi_c)
  # The CXX component, because projects (lockstep's included) may not enable C; lockstep uses MPI's C API
  # only and keeps the deprecated C++ bindings out (OMPI_SKIP_MPICXX).
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    add_library(lockstep::mpi_c INTERFACE IMPORTED)
    set_target_properties(lockstep::mpi_c PROPERTIES INTERFACE_LINK_LIBRARIES MPI::MPI_CXX)
  endif()
endif()

# The link interface of lockstep::lockstep (and lockstep::mpi), attached where the targets are known: to the
# build-tree targets as $<BUILD_INTERFACE:...> (so they are not exported), and to the imported targets by the
# installed package's config, on the consumer's machine, where CUDA may or may not exist.
function(lockstep_attach_dependencies core mpi wrap)
  set(libs Threads::Threads ZLIB::ZLIB lockstep::openblas lockstep::xxhash ${CMAKE_DL_LIBS})
  if(LOCKSTEP_CUDA_FOUND)
    list(APPEND libs CUDA::cudart CUDA::cublas lockstep::nccl)
  endif()
  if(TARGET lockstep::onednn)
    list(APPEND libs lockstep::onednn)
  endif()
  if(TARGET lockstep::mpi_c AND TARGET ${mpi})
    set(mpi_libs lockstep::mpi_c)
  endif()
  if(wrap)
    list(TRANSFORM libs REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
    list(TRANSFORM mpi_libs REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
  endif()
  set_property(TARGET ${core} APPEND PROPERTY INTERFACE_LINK_LIBRARIES ${libs})
  if(mpi_libs)
    set_property(TARGET ${mpi} APPEND PROPERTY INTERFACE_LINK_LIBRARIES ${mpi_libs})
  endif()
endfunction()
