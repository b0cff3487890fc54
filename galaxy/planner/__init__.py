"""Heterogeneity-aware planning: profile a cluster (``profile``, timing the model's blocks with
``blocks``), read and check the profile (``cluster``), predict any plan's step time or request
latency (``simulate``, over each group's events in ``group``) and memory (``memory``, per-layer memory
modes included), over the model's shapes in ``workload``, bound them over every split (``bounds``), search
the plans for the best one (``search``), and plan one run's per-layer activation memory (``activation``)."""
