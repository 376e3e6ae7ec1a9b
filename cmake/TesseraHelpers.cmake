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
