"""On a GPU machine: the rank forkserver's preload leaves CUDA untouched, and ranks forked from it use the GPU.

    python3 bench/device/forkserver_cuda_check.py      # prints one JSON line; exit 1 when a check fails

A process that initialised CUDA cannot be forked into ranks that use it; ``galaxy.cli.rank_processes`` forks
every local rank from a forkserver that imported ``galaxy.cli.rank_forkserver``. This imports that module in a
fresh process and reports whether CUDA was initialised there (and whether the driver library was merely loaded,
which forking survives), then forks two ranks that each multiply on GPU 0."""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE = ("import galaxy.cli.rank_forkserver, torch, json; maps = open('/proc/self/maps').read(); "
         "print(json.dumps({'cuda_initialized': torch.cuda.is_initialized(), 'libcuda_mapped': 'libcuda' in maps}))")


def rank(index: int, launch, payload) -> None:
    import torch

    x = torch.randn(1024, 1024, device="cuda:0")
    print(json.dumps({"rank": index, "gpu_sum_finite": bool(torch.isfinite((x @ x).sum()).item()),
                      "forked_from_the_forkserver": os.getppid() != payload}), flush=True)


if __name__ == "__main__":
    from galaxy.cli.launch import Launch, launch_ranks
    from galaxy.config import GalaxyConfig

    probe = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                      check=True).stdout)
    code = launch_ranks(rank, Launch(2, None, None, None), os.getpid(), GalaxyConfig())
    print(json.dumps({"preload": probe, "launch_exit_code": code, "python": sys.version.split()[0]}))
    sys.exit(0 if code == 0 and not probe["cuda_initialized"] else 1)
