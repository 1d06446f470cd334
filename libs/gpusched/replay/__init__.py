"""`gpusched replay`: what the control plane would have done with a cluster's past.

A discrete-event replay on a virtual clock that runs the decision code the services
run, with no bus and no database in the loop: admission's scheduling pass
(``gpusched.admission.planning.plan``) on the capacity ledger, the elastic
controller (``gpusched.preemption.policy.decide`` with its signal windows), the
eviction saga (``gpusched.domain.saga``) with the deadline policies per priority
class, the lost-work rule and the price book. The same workload is replayed under
several policies in one run, so each figure has its baselines beside it.

One module per concept:
- ``workload``: what arrives: training jobs from a trace (or a CSV), the inference
  services, and the parameters of the experiment;
- ``traces``: the readers of the openb and Philly files and of a user's CSV (I/O);
- ``demand``: the inference demand curve (diurnal, surges, noise; seeded);
- ``pools``: which nodes are dedicated to inference under each policy;
- ``engine``: the event loop and the glue the services have around the pure code;
- ``policies``: gpusched, its ablations, the static split and Kubernetes-native
  preemption, as settings of the engine;
- ``metrics``: what a run measured, and its summary;
- ``report``: the JSON summary and the HTML report with plots (writes files).
"""
