# SPDX-License-Identifier: Apache-2.0
# rp_cc_library / rp_cc_binary / rp_cc_test: one way to declare targets.

set(RP_WARNINGS -Wall -Wextra -Wshadow -Wundef -Wnon-virtual-dtor)
if(RP_WERROR)
  list(APPEND RP_WARNINGS -Werror)
endif()

function(_rp_common_setup target)
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR} ${CMAKE_BINARY_DIR}/generated)
  target_compile_options(${target} PRIVATE ${RP_WARNINGS})
endfunction()

# rp_cc_library(NAME name SRCS ... DEPS ...) -> static library rp_<name>, alias rp::<name>
function(rp_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_library(rp_${A_NAME} STATIC ${A_SRCS})
  add_library(rp::${A_NAME} ALIAS rp_${A_NAME})
  _rp_common_setup(rp_${A_NAME})
  target_link_libraries(rp_${A_NAME} PUBLIC ${A_DEPS})
endfunction()

function(rp_cc_binary)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  _rp_common_setup(${A_NAME})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
endfunction()

# rp_cc_test(NAME name SRCS ... DEPS ... LABELS ... TIMEOUT s)
function(rp_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  _rp_common_setup(${A_NAME})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main)
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  gtest_discover_tests(${A_NAME}
    PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()
