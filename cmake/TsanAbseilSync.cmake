# TSan builds only (ELDR_SANITIZE=thread): makes the system Abseil's synchronization visible to
# ThreadSanitizer (see cmake/sanitizers/tsan_absl_sync.cc). The shared library is linked first into
# every target created after this file is included, so its definitions win the dynamic lookup.
add_library(eldr_tsan_absl_sync SHARED ${CMAKE_CURRENT_LIST_DIR}/sanitizers/tsan_absl_sync.cc)
target_link_libraries(eldr_tsan_absl_sync PRIVATE absl::synchronization absl::time ${CMAKE_DL_LIBS})
link_libraries(eldr_tsan_absl_sync)
