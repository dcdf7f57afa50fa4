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

# A stand-in driver whose handles collide with the shim's tag range, in its own
# directory as libcuda.so.1, and a program that calls it through the shim.
add_library(collide_driver SHARED ${CMAKE_SOURCE_DIR}/tests/shim/c/collide_driver.c)
target_include_directories(collide_driver PRIVATE ${CUINTERPOSE_CUDA_INCLUDE})
target_compile_options(collide_driver PRIVATE -fvisibility=hidden)
set_target_properties(collide_driver PROPERTIES OUTPUT_NAME cuda PREFIX lib SUFFIX .so.1
                      LIBRARY_OUTPUT_DIRECTORY ${_shim_tests_dir}/collide)
target_link_options(collide_driver PRIVATE -Wl,-soname,libcuda.so.1)
add_executable(shim_collide ${CMAKE_SOURCE_DIR}/tests/shim/c/collide_prog.c)
target_include_directories(shim_collide PRIVATE ${CUINTERPOSE_CUDA_INCLUDE})
target_link_libraries(shim_collide PRIVATE dl)
set_target_properties(shim_collide PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${_shim_tests_dir})

# Preloaded after the shim: getsockopt(SO_PEERCRED) fails, for the control
# server's refusal of a peer it cannot name.
add_library(peercred_fail SHARED ${CMAKE_SOURCE_DIR}/tests/shim/c/peercred_fail.c)
set_target_properties(peercred_fail PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${_shim_tests_dir})

# shim_c/xxh64.h on chosen lengths, seeds and piece sizes (the stored parts' sums).
add_executable(xxh64_prog ${CMAKE_SOURCE_DIR}/tests/shim/c/xxh64_prog.c)
target_include_directories(xxh64_prog PRIVATE ${CMAKE_SOURCE_DIR}/shim_c)
set_target_properties(xxh64_prog PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${_shim_tests_dir})
