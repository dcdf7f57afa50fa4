# C test programs for tests/shim (included from shim_c/CMakeLists.txt):
#   shim_direct  links the driver directly (the simulated libcuda.so.1; at run
#                time the library path decides which libcuda.so.1 is loaded);
#   shim_dlsym   reaches the driver through dlopen("libcuda.so.1") + dlsym.
# Both go into ${CMAKE_BINARY_DIR}/tests/shim.
set(_shim_tests_dir ${CMAKE_BINARY_DIR}/tests/shim)
add_executable(shim_direct ${CMAKE_SOURCE_DIR}/tests/shim/c/shim_prog.c)
target_include_directories(shim_direct PRIVATE ${CUINTERPOSE_CUDA_INCLUDE})
target_link_libraries(shim_direct PRIVATE cuinterpose_sim)
set_target_properties(shim_direct PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${_shim_tests_dir}
                      SKIP_BUILD_RPATH ON)

add_executable(shim_dlsym ${CMAKE_SOURCE_DIR}/tests/shim/c/shim_prog.c)
target_compile_definitions(shim_dlsym PRIVATE VIA_DLSYM=1)
target_include_directories(shim_dlsym PRIVATE ${CUINTERPOSE_CUDA_INCLUDE})
target_link_libraries(shim_dlsym PRIVATE dl)
set_target_properties(shim_dlsym PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${_shim_tests_dir})
