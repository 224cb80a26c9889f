"""The store's operations, each written once and without I/O.

An operation is a generator function taking the store's ``Core`` and the caller's
arguments: it validates them, yields effects (``store.ops.effects``: send these commands,
watch these keys, sleep) and turns what comes back into its result or a typed error. The
sync and async stores run the same operations on their own executors (``store.io``).

    lifecycle   create, list, finish, delete, reap
    reads       load a request, a record, a partition, a connection
    fields      update attributes, final outputs, token and consumed counts
    reports     worker-graph rank reports and the advance to the next pass
    merges      merge_publish_info, server-side or optimistic
    leases      claim, release, renew, schedule, due steps
    replicas    heartbeats of the conductor replicas
    scan        reads of the tools that walk a namespace (migrate, top, history)
"""
