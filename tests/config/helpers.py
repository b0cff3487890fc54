"""A small BERT config shared by the config tests."""

from galaxy.config import GalaxyConfig

BASE = dict(hidden_size=24, num_attention_heads=6, intermediate_size=40, seq_length=12, vocab_size=50)


def resolve(world, **extra):
    return GalaxyConfig.from_dict(dict(BASE, **extra)).resolve_plan(world)
