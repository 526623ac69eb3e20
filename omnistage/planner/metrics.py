"""The planner's decisions as Prometheus metrics, for users whose own autoscaler acts on them (a KEDA
ScaledObject or an HPA external metric on `omnistage_planner_desired_replicas`): docs/planner.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from omnistage.planner.controller import Decision, Planner

DESIRED_REPLICAS = "omnistage_planner_desired_replicas"


class PlannerMetrics:
    def __init__(self, pipeline: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels, r = ["pipeline", "stage"], self.registry
        self.pipeline = pipeline
        self.desired = Gauge(DESIRED_REPLICAS, "Replicas the stage planner wants for the stage", labels, registry=r)
        self.needed = Gauge("omnistage_planner_needed_replicas", "Replicas the stage would get if the pipeline's "
                            "budget were unlimited (above desired: the budget holds it back)", labels, registry=r)
        self.capacity = Gauge("omnistage_planner_capacity", "Work units per second one replica serves, as measured",
                              labels, registry=r)
        self.load = Gauge("omnistage_planner_offered_load", "Work units per second offered to the stage, queue "
                          "to drain included", labels, registry=r)
        self.utilization = Gauge("omnistage_planner_utilization", "Offered load over the capacity of the replicas "
                                 "running (above 1: the stage is the bottleneck)", labels, registry=r)
        self.in_transit = Gauge("omnistage_planner_in_transit", "Of the offered load, work units per second that "
                                "an upstream's catch-up sends above what the upstream is offered (planned as "
                                "backlog, not as a steady rate)", labels, registry=r)
        self.demand = Gauge("omnistage_planner_demand_per_request", "Work units one request entering the pipeline "
                            "takes at the stage: its work per request times the share of requests reaching it",
                            labels, registry=r)
        self.dispersion = Gauge("omnistage_planner_arrival_dispersion", "How much the requests arriving at the "
                                "stage per interval vary against a Poisson count's variance, as the planner uses "
                                "it (1: Poisson; lower: steadier, so a load is sure sooner)", labels, registry=r)
        self.forecast = Gauge("omnistage_planner_forecast_load", "Work units per second the requests the front door "
                              "admitted over the last window send the stage, at each request class's demand",
                              labels, registry=r)
        self.class_demand = Gauge("omnistage_planner_class_demand", "Work units one request of the class takes at "
                                  "the stage (those the stage does not serve counting 0), from finished requests' "
                                  "traces", ["pipeline", "class", "stage"], registry=r)
        self.changes = Counter("omnistage_planner_changes", "Replica count changes the planner made, by direction",
                               [*labels, "direction"], registry=r)
        self.decisions = Counter("omnistage_planner_decisions", "Decisions the planner made for the pipeline "
                                 "(a change of replicas or none)", ["pipeline"], registry=r)

    def record(self, planner: Planner, decision: Decision) -> None:
        self.decisions.labels(self.pipeline).inc()
        for stage, n in planner.desired().items():
            est = decision.estimates[stage]
            self.desired.labels(self.pipeline, stage).set(n)
            if stage in decision.plan.stages:
                self.needed.labels(self.pipeline, stage).set(decision.plan.stages[stage].need)
            self.capacity.labels(self.pipeline, stage).set(est.capacity)
            self.load.labels(self.pipeline, stage).set(est.load)
            self.utilization.labels(self.pipeline, stage).set(est.utilization)
            self.in_transit.labels(self.pipeline, stage).set(est.in_transit)
            self.demand.labels(self.pipeline, stage).set(decision.demand.get(stage, 0.0))
            self.dispersion.labels(self.pipeline, stage).set(planner.dispersions.get(stage, 1.0))
            self.forecast.labels(self.pipeline, stage).set(decision.forecast.get(stage, 0.0))
        for cls, d in decision.classes.items():
            for stage, units in d.units.items():
                self.class_demand.labels(self.pipeline, cls, stage).set(units)
        for c in decision.changes:
            self.changes.labels(self.pipeline, c.stage, "up" if c.after > c.before else "down").inc()
