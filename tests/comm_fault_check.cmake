# Runs comm_fault_mpi under mpirun and checks that a failed or stuck rank ends the job in time:
#
#   cmake "-DMPIEXEC=/usr/bin/mpirun|--allow-run-as-root|..." -DDRIVER=path/to/comm_fault_mpi -DMODE=throw|hang -DTIMEOUT_S=3
#         -DMARGIN_S=20 "-DEXPECT=<regex the output must match>" -P comm_fault_check.cmake
#
# MPIEXEC is the launcher and its options, separated by '|'. Passes when mpirun exits within
# TIMEOUT_S + MARGIN_S seconds, with a non-zero status, and its output
# (stdout and stderr merged) matches EXPECT.
foreach(var MPIEXEC DRIVER MODE TIMEOUT_S EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "comm_fault_check.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT DEFINED MARGIN_S)
  set(MARGIN_S 20)
endif()
math(EXPR limit "${TIMEOUT_S} + ${MARGIN_S}")

string(REPLACE "|" ";" MPIEXEC "${MPIEXEC}")
string(TIMESTAMP start "%s" UTC)
execute_process(
  COMMAND ${MPIEXEC} -np 2 -x LOCKSTEP_COMM_TIMEOUT=${TIMEOUT_S}
          ${DRIVER} ${MODE}
  RESULT_VARIABLE status
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output
  TIMEOUT ${limit})
string(TIMESTAMP stop "%s" UTC)
math(EXPR took "${stop} - ${start}")
message(STATUS "comm_fault_mpi ${MODE}: exit status '${status}' after ${took} s (limit ${limit} s)\n${output}")

if(status MATCHES "timeout")
  message(FATAL_ERROR "comm_fault_mpi ${MODE}: the job did not end within ${limit} s (hang)")
endif()
if(status EQUAL 0)
  message(FATAL_ERROR "comm_fault_mpi ${MODE}: the job exited with status 0; expected a failure")
endif()
if(took GREATER limit)
  message(FATAL_ERROR "comm_fault_mpi ${MODE}: took ${took} s, more than ${limit} s")
endif()
if(NOT output MATCHES "${EXPECT}")
  message(FATAL_ERROR "comm_fault_mpi ${MODE}: the output does not match '${EXPECT}'")
endif()
