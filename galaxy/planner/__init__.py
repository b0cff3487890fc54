"""Heterogeneity-aware planning: profile a cluster (``profile``, timing the model's blocks with
``blocks``), read and check the profile (``cluster``), predict any plan's step time or request
latency and memory (``cost``, over the model's shapes in ``workload``), and search the plans for the
best one (``search``)."""
