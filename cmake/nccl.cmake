# NCCL detection for the GPU communicator (src/parallel/nccl_communicator.cpp).
#
# Included from the top-level CMakeLists.txt after moeforge_lib is defined:
#   include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/nccl.cmake)
#   mf_link_nccl(moeforge_lib)
#
# Looks in NCCL_ROOT / $ENV{NCCL_ROOT}, the CUDA toolkit, then the system. Without CUDA, or without
# NCCL, it does nothing: nccl_communicator.cpp compiles to an empty object unless
# MOEFORGE_WITH_NCCL is defined, and only the TCP communicator exists.
option(MOEFORGE_NCCL "Build the NCCL communicator when CUDA is on and NCCL is found" ON)

function(mf_link_nccl target)
  if(NOT MOEFORGE_CUDA OR NOT MOEFORGE_NCCL)
    message(STATUS "moeforge: NCCL communicator OFF (CUDA ${MOEFORGE_CUDA}, MOEFORGE_NCCL ${MOEFORGE_NCCL})")
    return()
  endif()
  set(hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR} /usr/local/cuda)
  find_path(MF_NCCL_INCLUDE_DIR nccl.h HINTS ${hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(MF_NCCL_LIBRARY nccl HINTS ${hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(NOT MF_NCCL_INCLUDE_DIR OR NOT MF_NCCL_LIBRARY)
    message(STATUS "moeforge: NCCL not found (set NCCL_ROOT); NCCL communicator OFF")
    return()
  endif()
  file(STRINGS ${MF_NCCL_INCLUDE_DIR}/nccl.h mf_nccl_lines REGEX "^#define NCCL_(MAJOR|MINOR) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*NCCL_MINOR +([0-9]+).*" "\\1.\\2" mf_nccl_version "${mf_nccl_lines}")
  if(mf_nccl_version VERSION_LESS 2.18)
    message(STATUS "moeforge: NCCL ${mf_nccl_version} is older than 2.18 (ncclCommSplit); NCCL communicator OFF")
    return()
  endif()
  message(STATUS "moeforge: NCCL communicator ON (NCCL ${mf_nccl_version}, ${MF_NCCL_LIBRARY})")
  target_include_directories(${target} PUBLIC ${MF_NCCL_INCLUDE_DIR})
  target_link_libraries(${target} PUBLIC ${MF_NCCL_LIBRARY})
  target_compile_definitions(${target} PUBLIC MOEFORGE_WITH_NCCL=1)
endfunction()
