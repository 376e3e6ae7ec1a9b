// The scheduler's metrics: every counter and gauge it exports, with its help
// text (docs/metrics.md lists them). Apart from scheduler.cc so that the loop
// reads without a page of registrations in front of it.
#include "common/metrics.h"
#include "scheduler/scheduler.h"

namespace tessera {

Scheduler::Metrics::Metrics() {
  MetricsRegistry& r = MetricsRegistry::Global();
  heartbeats = r.GetCounter("tessera_scheduler_heartbeats_received_total",
                            "Heartbeats received from servers and workers.");
  dead_nodes = r.GetCounter(
      "tessera_scheduler_dead_nodes_total",
      "Nodes declared dead for want of heartbeats (each ends the job, but "
      "a server of a replicated job whose slices have a live replica and a "
      "worker of an elastic job while enough remain).");
  failovers = r.GetCounter(
      "tessera_scheduler_failovers_total",
      "Servers declared dead (or that left) whose key slices failed over to "
      "a replica (TESSERA_REPLICAS > 1).");
  servers_left = r.GetCounter(
      "tessera_scheduler_servers_left_total",
      "Servers of a replicated job that left it (SIGTERM: SERVER_LEAVE), "
      "their key slices failing over to a replica.");
  replacements = r.GetCounter(
      "tessera_scheduler_replacements_total",
      "Dead servers whose rank a spare or a restarted server took "
      "(TESSERA_REPLICAS > 1; it then catches up by state transfer).");
  handbacks = r.GetCounter(
      "tessera_scheduler_handbacks_total",
      "Replacement servers that took back their place in their key slices' "
      "chains once caught up (a hand-back at a round boundary; "
      "TESSERA_REPLICAS > 1).");
  handback_retries = r.GetCounter(
      "tessera_scheduler_handback_retries_total",
      "Hand-backs started again because a server had not reported its part "
      "within 10 s (a lost report, or a round boundary that did not come).");
  spares = r.GetGauge("tessera_scheduler_spare_servers",
                      "Spare servers (TESSERA_SPARE=1) waiting for a server "
                      "to die.");
  barriers_released = r.GetCounter("tessera_scheduler_barriers_released_total",
                                   "Barriers released (once per group).");
  notice_resends = r.GetCounter(
      "tessera_scheduler_notice_resends_total",
      "Notices (node tables, the job's end) sent again for want of an "
      "acknowledgement.");
  ignored_messages = r.GetCounter(
      "tessera_scheduler_ignored_messages_total",
      "Messages the scheduler dropped: data-plane messages, registrations "
      "that are malformed or claim keys that are not theirs.");
  registrations = r.GetCounter(
      "tessera_scheduler_registrations_total",
      "Registrations received (first lives, restarts and repeats).");
  registered_servers =
      r.GetGauge("tessera_scheduler_registered_nodes",
                 "Nodes registered, by role.", {{"role", "server"}});
  registered_workers =
      r.GetGauge("tessera_scheduler_registered_nodes",
                 "Nodes registered, by role.", {{"role", "worker"}});
  finished_workers = r.GetGauge("tessera_scheduler_finished_workers",
                                "Workers that have finished their work.");
  workers_in_job = r.GetGauge(
      "tessera_scheduler_workers_in_job",
      "Workers in the job's membership: registered and not left (an elastic "
      "job's workers leave by goodbye or death, TESSERA_ELASTIC).");
  workers_joined = r.GetCounter(
      "tessera_scheduler_workers_joined_total",
      "Workers that joined an elastic job (TESSERA_ELASTIC) while it ran.");
  workers_left = r.GetCounter(
      "tessera_scheduler_workers_left_total",
      "Workers of an elastic job (TESSERA_ELASTIC) that left while it ran: "
      "said goodbye or were declared dead.");
  formed = r.GetGauge("tessera_scheduler_job_formed",
                      "1 once every node registered and got the node table.");
  oldest_heartbeat_age = r.GetGauge(
      "tessera_scheduler_oldest_heartbeat_age_seconds",
      "Seconds since the node heard from longest ago was last heard from "
      "(a node is declared dead past PS_HEARTBEAT_TIMEOUT).");
}

}  // namespace tessera
