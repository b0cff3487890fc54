"""Bottleneck adapters (Houlsby / Pfeiffer) and Ladder Side-Tuning, both in the CON block's layout."""

from galaxy.adapters.bottleneck import (ADAPTER_SITES, AdapterAfter, BottleneckAdapter,
                                        add_adapters, init_adapter_weights,
                                        mark_only_adapters_as_trainable)
from galaxy.adapters.side import LadderSideNetwork, SideSpec, add_side_network, mark_only_side_as_trainable

__all__ = ["ADAPTER_SITES", "AdapterAfter", "BottleneckAdapter",
           "add_adapters", "init_adapter_weights", "mark_only_adapters_as_trainable", "LadderSideNetwork",
           "SideSpec", "add_side_network", "mark_only_side_as_trainable"]
