# Runs tessera-sim on 200 nodes (20 servers, 180 workers) and checks its summary
# line: the job formed, every barrier took exactly 2 x 180 BARRIER messages
# (a request and a reply per worker), the scheduler handled at most about one
# heartbeat per node per second, the rounds' sums were exact and every survivor heard of
# the killed worker within the heartbeat time-out plus slack.
execute_process(COMMAND ${SIM} --nodes=200 --barriers=3 --idle_s=3 --rounds=3
                               --heartbeat_timeout_s=2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tessera-sim exited ${rc}\n${err}")
endif()
string(REGEX MATCH "SIM nodes=200 servers=20 workers=180 form_s=[0-9.]+ form_scheduler_msgs=[0-9]+ barrier_ms=[0-9.]+ barrier_msgs=([0-9]+) heartbeats_per_s=([0-9.]+) round_ms=[0-9.]+ detect_s=([0-9.]+) ok=1" line "${out}")
if(NOT line)
  message(FATAL_ERROR "no passing SIM summary line")
endif()
if(NOT CMAKE_MATCH_1 EQUAL 360)
  message(FATAL_ERROR "a barrier of 180 workers took ${CMAKE_MATCH_1} BARRIER messages, want 360")
endif()
# At most about one per node per second (a storm of heartbeats is the bug this
# catches); fewer only when the 200 nodes' threads are starved of the 2 cores
# (142/s in a CI run here at 745140a, beside a TSan build), so the lower bound
# only asks that they flow.
if(CMAKE_MATCH_2 LESS 50 OR CMAKE_MATCH_2 GREATER 230)
  message(FATAL_ERROR "heartbeats at the scheduler ${CMAKE_MATCH_2}/s, want at most about 200 (one per node per second) and at least 50")
endif()
if(CMAKE_MATCH_3 GREATER 12)
  message(FATAL_ERROR "the death was told after ${CMAKE_MATCH_3} s (time-out 2 s)")
endif()
