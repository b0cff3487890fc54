"""The preload of the forkserver that local ranks are forked from (``galaxy.cli.rank_processes``): imported
there and nowhere else, for its effects on that process.

It imports what every rank imports (torch, the run and training code, torch._dynamo and the modules that bind
torch's WORLD group on import, ``import_world_binders``) so that a forked rank has it, and it
blocks SIGINT and SIGTERM in the forkserver: a stop signal sent to the whole process group (Ctrl-C, ``timeout``,
a scheduler) must reach the ranks, which save a checkpoint and stop, not end the forkserver, whose end would
kill them (their parent-death signal). A rank forked from it starts with the two signals blocked, as a spawned
rank does (the launcher blocks them while it starts ranks); ``galaxy.cli.launch.sigterm_interrupts`` unblocks
them once its handlers are set, and one that came meanwhile is delivered then. And it dies with its launcher at
once (the parent-death signal; without it the forkserver would end only after its interpreter's teardown, seconds
with torch imported, while its ranks train on)."""

import signal

import torch  # noqa: F401
# Every training rank imports torch._dynamo at its first parameter init or optimizer (torch wraps them in
# ``_disable_dynamo``, which imports it on its first call): about 1 s of CPU in each rank forked, paid here once.
import torch._dynamo  # noqa: F401

import galaxy.cli.run  # noqa: F401
import galaxy.train.loop  # noqa: F401
from galaxy.cli.launch import STOP_SIGNALS, killed_with_parent
from galaxy.core.context import import_world_binders

import_world_binders()  # no process group here yet: they bind the placeholder, as before any group is made

signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
killed_with_parent()
