"""``mstar-store simulate``: conductor replicas sharing one store, killed at random, checked.

The replicas are the library's runtime (``store.Replica``, or ``store.AsyncReplica``); the
simulation brings only a model and a planner, and plays the world around them. Read top to
bottom as a run flows: ``model`` (what the requests and workers do, as a pure function of
the seed), ``planner`` (the model behind the runtime's ``Planner``), ``transport`` (the
lists between processes), ``conductor`` (one replica process: a runtime fed from its
inbox), ``measure`` (its latencies), ``fleet`` (the replica processes, the workers, the
random delivery, kills and drains), ``takeovers`` (how soon a dead or drained replica's
steps are taken), ``reference`` (the crash-free run and how final states are compared),
``harness`` (one whole simulation and its summary), ``progress`` and ``command``.
"""
