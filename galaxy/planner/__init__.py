"""Heterogeneity-aware planning: profile a cluster (``profile``, timing the model's blocks with
``blocks``), read and check the profile (``cluster``), predict any plan's step time or request
latency (``simulate``, over each group's events in ``group``) and memory (``memory``), over the
model's shapes in ``workload``, bound them over every split (``bounds``), and search the plans for
the best one (``search``)."""
