"""``mstar-store simulate``: conductor replicas sharing one store, killed at random, checked.

Read top to bottom as a run flows: ``model`` (what the requests and workers do, as a pure
function of the seed), ``replica`` (one conductor replica's loop over the store), ``fleet``
(the replica processes, the workers and the random delivery between them), ``reference``
(the crash-free run and how final states are compared), ``harness`` (one whole simulation
and its summary), ``progress`` and ``cli``.
"""
