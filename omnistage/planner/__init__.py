"""The stage planner: replicas per stage sized from measured stage capacity, to targets and a budget.

- `load`: counters each stage replica exports -> per-stage throughput, busy time, capacity of one
  replica and offered load;
- `graph`: the stage graph: an upstream's catch-up read as backlog in transit, not as a rise in load; the
  share of requests reaching each stage and the work a pipeline request takes there;
- `sizing`: those numbers -> replicas per stage, the pipeline sized as a whole within a budget;
- `decisions`: a plan -> changes, up at once and down after a delay, with hysteresis.

All pure; the controllers that observe and act (the operator's, `omnistage serve --autoscale`'s) call them.
It lives here rather than in the operator because both of those run it.
"""
