# tessera_library(NAME <name> SOURCES ... [DEPS ...] [PUBLIC_DEPS ...])
# Defines a static library tessera_<name> with the alias tessera::<name>.
function(tessera_library)
  cmake_parse_arguments(T "" "NAME" "SOURCES;DEPS;PUBLIC_DEPS" ${ARGN})
  add_library(tessera_${T_NAME} STATIC ${T_SOURCES})
  add_library(tessera::${T_NAME} ALIAS tessera_${T_NAME})
  target_include_directories(tessera_${T_NAME} PUBLIC
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
      $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}>)
  target_compile_options(tessera_${T_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_CXX_WARNINGS}>)
  target_link_libraries(tessera_${T_NAME} PUBLIC ${T_PUBLIC_DEPS} PRIVATE ${T_DEPS})
endfunction()

# tessera_executable(NAME <name> SOURCES ... [DEPS ...])
function(tessera_executable)
  cmake_parse_arguments(T "" "NAME" "SOURCES;DEPS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_compile_options(${T_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_CXX_WARNINGS}>)
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS})
endfunction()

# tessera_test(NAME <name> SOURCES ... [DEPS ...] [LABELS ...] [TIMEOUT s])
# A GoogleTest binary registered with ctest as one test.
function(tessera_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_compile_options(${T_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TESSERA_CXX_WARNINGS}>)
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT}
      ENVIRONMENT "TESSERA_BUILD_DIR=${PROJECT_BINARY_DIR};TESSERA_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
  if(T_LABELS)
    set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}")
  endif()
endfunction()

# --- libFuzzer targets --------------------------------------------------------------
# libFuzzer needs clang. The project compiler may be GCC, so fuzzers are compiled
# directly with a clang++ (the project's own when it is clang), from their sources,
# and linked against the same libraries the project uses.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  set(TESSERA_FUZZ_CXX "${CMAKE_CXX_COMPILER}")
else()
  find_program(TESSERA_FUZZ_CXX NAMES clang++ clang++-18 clang++-17 clang++-16
                                      clang++-15 clang++-14)
endif()

# Library files behind the given targets, transitively ($<TARGET_FILE:...> each).
function(tessera_collect_link_files out)
  set(queue ${ARGN})
  set(seen "")
  set(files "")
  while(queue)
    list(POP_FRONT queue item)
    if(item MATCHES "^\\$<LINK_ONLY:(.+)>$")
      set(item "${CMAKE_MATCH_1}")
    endif()
    if(item IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${item}")
    if(TARGET "${item}")
      get_target_property(type "${item}" TYPE)
      if(NOT type STREQUAL "INTERFACE_LIBRARY")
        list(APPEND files "$<TARGET_FILE:${item}>")
      endif()
      get_target_property(deps "${item}" INTERFACE_LINK_LIBRARIES)
      if(deps)
        list(APPEND queue ${deps})
      endif()
    elseif(item MATCHES "^-" OR IS_ABSOLUTE "${item}")
      list(APPEND files "${item}")
    endif()
  endwhile()
  set(${out} "${files}" PARENT_SCOPE)
endfunction()

# tessera_fuzzer(NAME n SOURCES ... LIBS imported-targets... [DEPENDS files/targets...]
#                [INCLUDES dirs...] RUNS N MAX_LEN M CORPUS seed-dir)
# Builds <n>_fuzzer with clang's libFuzzer + ASan + UBSan and registers the ctest
# fuzz_<n> (label fuzz), which runs it a fixed number of times from a fixed seed.
function(tessera_fuzzer)
  cmake_parse_arguments(F "" "NAME;RUNS;MAX_LEN;CORPUS" "SOURCES;LIBS;DEPENDS;INCLUDES" ${ARGN})
  if(NOT TESSERA_FUZZ_CXX)
    message(STATUS "Tessera: no clang++ found; fuzzer ${F_NAME} and test fuzz_${F_NAME} skipped")
    return()
  endif()
  # A fuzzer brings its own sanitizers (ASan + UBSan) and links the project's libraries,
  # which under TSan carry TSan calls that an ASan binary cannot resolve.
  if(TESSERA_SANITIZE STREQUAL "thread")
    message(STATUS "Tessera: TESSERA_SANITIZE=thread; fuzzer ${F_NAME} and test fuzz_${F_NAME} skipped")
    return()
  endif()
  # The thread-safety build checks the project's code; a fuzzer is compiled without the
  # analysis's flags (its own command line above), the same as in the main build.
  if(TESSERA_THREAD_SAFETY)
    message(STATUS "Tessera: TESSERA_THREAD_SAFETY; fuzzer ${F_NAME} left to the main build")
    return()
  endif()
  tessera_collect_link_files(libs ${F_LIBS})
  set(absl_includes "$<TARGET_PROPERTY:absl::status,INTERFACE_INCLUDE_DIRECTORIES>")
  set(binary ${CMAKE_CURRENT_BINARY_DIR}/${F_NAME}_fuzzer)
  set(includes -I${PROJECT_SOURCE_DIR} -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_BINARY_DIR})
  foreach(dir ${F_INCLUDES})
    list(APPEND includes -I${dir})
  endforeach()
  add_custom_command(OUTPUT ${binary}
    COMMAND ${TESSERA_FUZZ_CXX} -std=c++20 -O1 -g -fno-omit-frame-pointer
            -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
            ${includes}
            "$<$<BOOL:${absl_includes}>:-I$<JOIN:${absl_includes},;-I>>"
            ${F_SOURCES} ${libs} -pthread -o ${binary}
    DEPENDS ${F_SOURCES} ${F_DEPENDS}
    COMMENT "Building libFuzzer target ${F_NAME}_fuzzer with ${TESSERA_FUZZ_CXX}"
    COMMAND_EXPAND_LISTS VERBATIM)
  add_custom_target(${F_NAME}_fuzzer ALL DEPENDS ${binary})
  # New inputs go to the build tree; the seeds in the source tree stay read-only.
  set(work ${CMAKE_CURRENT_BINARY_DIR}/fuzz_${F_NAME}_corpus)
  file(MAKE_DIRECTORY ${work})
  add_test(NAME fuzz_${F_NAME}
    COMMAND ${binary} -runs=${F_RUNS} -seed=1 -max_len=${F_MAX_LEN} ${work} ${F_CORPUS})
  set_tests_properties(fuzz_${F_NAME} PROPERTIES TIMEOUT 600 LABELS fuzz)
endfunction()
