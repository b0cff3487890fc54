"""Emulated clusters (galaxy/emulate): cluster file validation, Gloo through shaped links, bandwidth and
CPU quotas as configured, and cleanup on every exit path. The emulation tests need root, iproute2 and
the cgroup v1 cpu controller; elsewhere they skip, naming what is missing."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from galaxy.config import ConfigError
from galaxy.emulate import cgroups, network
from galaxy.emulate.cluster import Cluster, RankSpec
from galaxy.emulate.emulator import LOCK_DIR, NAME_PATTERN, EmulatedCluster, _wait_joined, remove_stale_runs
from galaxy.emulate.host import HostCommandError, missing_prerequisite
from galaxy.emulate.launch import run_emulated
from galaxy.planner.cluster import OPS
from tests import REPO
from tests.in_process import run_script

# Subprocess and wait limits are hang guards, not timings: generous enough for a host busy with other work
# (a refusal that takes 3 s alone took over 60 s in one of 30 runs beside a loaded host, 2026-12-02).
HANG_GUARD_S = 300
MISSING = missing_prerequisite()
needs_host = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


# ----------------------------------------------------------------------------- the cluster file


@pytest.mark.parametrize("raw, key", [
    ({"links": {"bandwidth_mbit": 100}}, "'ranks'"),
    ({"ranks": []}, "'ranks'"),
    ({"ranks": [{"compute_share": 0}]}, "'ranks[0].compute_share'"),
    ({"ranks": [{}, {"compute_share": "half"}]}, "'ranks[1].compute_share'"),
    ({"ranks": [{"compute_share": 0.001}]}, "'ranks[0].compute_share'"),
    ({"ranks": [{}, {"bandwidth_mbit": -5}]}, "'ranks[1].bandwidth_mbit'"),
    ({"ranks": [{}], "links": {"bandwidth_mbit": True}}, "'links.bandwidth_mbit'"),
    ({"ranks": [{}], "links": {"bandwidth_mbit": 1e9}}, "'links.bandwidth_mbit'"),
    ({"ranks": [{}], "links": {"bandwith_mbit": 100}}, "'bandwith_mbit'; did you mean 'bandwidth_mbit'"),
    ({"ranks": [{"compute": 1.0}]}, "'compute'; did you mean 'compute_share'"),
    ({"ranks": [{}], "latency_ms": 5}, "'latency_ms'"),
    ({"ranks": [{}], "cpu_period_us": 10}, "'cpu_period_us'"),
    ({"ranks": [{}], "cpu_emulation": "slow"}, "'cpu_emulation'"),
    ({"ranks": [5]}, "'ranks[0]'"),
    ([{"compute_share": 1.0}], "must be a JSON object"),
])
def test_cluster_file_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        Cluster.from_dict(raw)
    message = str(err.value)
    assert key in message and "\n" not in message, message


def test_cluster_file_defaults_and_overrides(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ranks": [{"compute_share": 1}, {"compute_share": 0.5, "bandwidth_mbit": 20},
                                          {"bandwidth_mbit": None}],
                                "links": {"bandwidth_mbit": 100}, "cpu_period_us": 50000}))
    cluster = Cluster.from_file(str(path))
    assert cluster.world_size == 3
    assert [r.bandwidth_mbit for r in cluster.ranks] == [100.0, 20.0, None]
    assert [cluster.quota_us(r) for r in range(3)] == [50000, 25000, None]
    with pytest.raises(ConfigError, match="does not exist"):
        Cluster.from_file(str(tmp_path / "absent.json"))
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Cluster.from_file(str(path))


def test_cli_bad_input_gets_one_line(tmp_path):
    bad = tmp_path / "cluster.json"
    bad.write_text('{"ranks": [{"compute_share": -1}]}')
    # galaxy/emulate/__main__.py is run here, as ``python -m galaxy.emulate``
    for args, says in [([str(bad), "--", "true"], "'ranks[0].compute_share' must be a positive number"),
                       ([str(bad)], "name the command to run after '--'")]:
        done = subprocess.run([sys.executable, "-m", "galaxy.emulate", *args], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=HANG_GUARD_S)
        assert done.returncode == 2 and says in done.stderr.strip().splitlines()[-1], done.stderr


def test_not_root_gets_one_line():
    cluster = '{"ranks": [{}, {}]}'
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir="/tmp") as f:  # /tmp: readable by nobody too
        f.write(cluster)
        f.flush()
        os.chmod(f.name, 0o644)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        env = {**os.environ, "PYTHONPATH": REPO}
        if as_nobody and subprocess.run([*as_nobody, sys.executable, "-c", "import galaxy.emulate"], cwd=REPO,
                                        env=env, capture_output=True, timeout=HANG_GUARD_S).returncode != 0:
            pytest.skip(f"user nobody cannot run {sys.executable} on {REPO} (permissions)")
        done = subprocess.run([*as_nobody, sys.executable, "-m", "galaxy.emulate", f.name, "--", "true"],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_GUARD_S)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "error: cluster emulation needs root (network namespaces, tc, cgroups); run as root"], done.stderr


# ----------------------------------------------------------------------------- traffic and CPU

GLOO_RANK = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(5, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(x)
    expected = torch.arange(5, dtype=torch.float64) * sum(r + 1 for r in range(world))
    if not torch.equal(x, expected):
        sys.exit(f"rank {rank}: all_reduce gave {x.tolist()}, expected {expected.tolist()}")
    payload = torch.zeros(int(os.environ["NBYTES"]) // 4)
    start = time.perf_counter()  # before the barrier, which rank 0 leaves only after rank 1 entered it
    dist.barrier()
    if rank == 0:
        dist.send(payload, 1)
    else:
        dist.recv(payload, 0)
        mb_per_s = payload.numel() * 4 / (time.perf_counter() - start) / 1e6
        with open(os.environ["RESULT"], "w") as f:
            f.write(str(mb_per_s))
    dist.barrier()
    dist.destroy_process_group()
""")


@needs_host
def test_gloo_all_reduce_and_bandwidth_through_shaped_links(tmp_path):
    """2 ranks on 50 Mbit links: all_reduce sums right, and 4 MB from rank 0 to rank 1 arrive no
    faster than 50 Mbit/s = 6.25 MB/s: the link is shaped. Rank 1's clock starts before rank 0 can
    send, and load on the host can only slow the transfer, so this holds on any machine; how near the
    rate a quiet one comes (~0.96 of it, TCP/IP headers take ~4%) is bench/bench_link.py's to measure."""
    script, result = tmp_path / "rank.py", tmp_path / "mb_per_s"
    script.write_text(GLOO_RANK)
    cluster = Cluster.from_dict({"ranks": [{"compute_share": 1.0}] * 2, "links": {"bandwidth_mbit": 50}})
    env = {**os.environ, "PYTHONPATH": REPO, "NBYTES": str(4 << 20), "RESULT": str(result)}
    assert run_emulated(cluster, lambda rank: [sys.executable, str(script)], env) == 0
    measured = float(result.read_text())
    logging.getLogger(__name__).info("4 MB over a 50 Mbit link: %.2f MB/s", measured)
    assert 0 < measured < 1.05 * 6.25, measured  # the bucket lets 2 ms of traffic through at once; unshaped: GB/s


STAGGER_RANK = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    from galaxy.core.comm import Communicator
    from galaxy.planner.cluster import OPS
    from galaxy.planner.profile import measure_group
    from galaxy.core.context import import_world_binders
    import_world_binders()  # else the first functional collective binds WORLD past destroy: an abort at exit
    dist.init_process_group("gloo")
    comm = Communicator("probe", dist.get_rank(), dist.get_world_size())
    last, waited = measure_group(comm, torch.device("cpu"), {op: [1 << 20] for op in OPS}, reps=3)
    if dist.get_rank() == 0:
        with open(os.environ["RESULT"], "w") as f:
            json.dump({op: [last[op](1 << 20).item(), waited[op](1 << 20).item()] for op in last}, f)
    dist.destroy_process_group()
""")


@needs_host
def test_profiler_times_the_last_member_of_a_gloo_all_gather_apart(tmp_path):
    """Over a 50 Mbit link, 1 MiB, one member 5 ms late: the profiler reports every collective's two roles,
    the member that came last (from its arrival until it leaves) and those that waited for it (until they
    leave, less the wait). Asserted is what load cannot change: every role is timed, and the late member of
    an all-reduce is timed through the link, since its half of the sum must cross the 50 Mbit link after it
    arrives (512 KiB: 84 ms at least; a busy host only adds). How much later the last member of an
    all-gather leaves than the others (1.4-1.6x on a quiet machine) and that an all-reduce lets them go
    together is bench/bench_collective_roles.py's to measure: load stretches the roles unevenly."""
    script, result = tmp_path / "rank.py", tmp_path / "result.json"
    script.write_text(STAGGER_RANK)
    cluster = Cluster.from_dict({"ranks": [{"compute_share": 1.0}] * 2, "links": {"bandwidth_mbit": 50}})
    env = {**os.environ, "PYTHONPATH": REPO, "RESULT": str(result)}
    assert run_emulated(cluster, lambda rank: [sys.executable, str(script)], env) == 0
    times = json.loads(result.read_text())
    logging.getLogger(__name__).info("1 MiB at 50 Mbit, s (last member, the others): %s", times)
    assert sorted(times) == sorted(OPS), times
    assert all(last > 0 for last, _ in times.values()), times
    half_at_link_rate = (512 << 10) / (50e6 / 8)
    assert times["all_reduce"][0] >= 0.95 * half_at_link_rate, times  # the bucket lets 2 ms through at once


def test_placement_packs_ranks_onto_cores_and_fills_the_rest():
    """Whole cores for whole shares; a smaller share gets a core of its own while cores last (else the
    least loaded one it fits on), weighted by its share, capped by a quota only where it shares a core
    with another rank, the rest of a core to a filler; a cluster that does not fit, or a share above
    one core that is not whole, is refused in one line naming the fix."""
    def place(*shares, **keys):
        return cgroups.placement(Cluster.from_dict({"ranks": [{"compute_share": s} for s in shares], **keys}), [0, 1])

    one = cgroups.CORE_WEIGHT
    p = place(0.5, 1.0)
    assert [r.cpus for r in p.ranks] == [(1,), (0,)] and [r.quota_us for r in p.ranks] == [None, None]
    assert p.ranks[0].weight == one // 2 and p.fillers == ((1, one // 2),)
    p = place(0.5, 0.5)  # a core each
    assert [r.cpus for r in p.ranks] == [(0,), (1,)] and p.fillers == ((0, one // 2), (1, one // 2))
    assert [r.quota_us for r in p.ranks] == [None, None]
    p = place(0.5, 0.5, 1.0)  # the two halves share a core, each capped at its share, no filler
    assert [r.cpus for r in p.ranks] == [(1,), (1,), (0,)] and p.fillers == ()
    assert [r.quota_us for r in p.ranks] == [5000, 5000, None]
    p = place(None, 2.0, cpu_emulation="cores")
    assert p.ranks[0].cpus is None and p.ranks[1].cpus == (0, 1)
    assert place(0.25, 2.0, cpu_emulation="quota").ranks[1].cpus is None  # no pinning, quotas only
    assert place(2.0, cpu_emulation="quota").ranks[0].quota_us == 20000
    p = place(0.5, 1.0, cpu_emulation="dilate")  # a core each, no filler, no quota: the rank stretches its ops
    assert [r.cpus for r in p.ranks] == [(0,), (1,)] and p.fillers == () and [r.quota_us for r in p.ranks] == [None] * 2
    with pytest.raises(ConfigError, match="'cpu_emulation' 'dilate' gives every rank cores of its own: 3") as err:
        place(0.5, 0.5, 0.5, cpu_emulation="dilate")
    assert "'cpu_emulation': 'cores'" in str(err.value) and "\n" not in str(err.value)
    for shares, says in [((1.0, 1.0, 0.5), "do not fit the 2 cores of this machine"),
                         ((0.75, 0.75, 0.5), "do not fit the 2 cores of this machine"),
                         ((1.5,), "not a whole number of cores")]:
        with pytest.raises(ConfigError, match=says) as err:
            place(*shares)
        assert "cpu_emulation" in str(err.value) and "\n" not in str(err.value)


def test_training_cli_refuses_a_cluster_that_does_not_fit_this_machine(tmp_path):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"ranks": [{"compute_share": len(os.sched_getaffinity(0))}, {"compute_share": 1.0}]}))
    # in this process (tests.in_process): refused before any rank or emulated host starts
    out = run_script(["pretrain_galaxy.py", "--emulate", str(cluster)], timeout=HANG_GUARD_S)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(cluster) in out.stderr and "'cpu_emulation': 'quota'" in out.stderr, out.stderr


def test_dilate_sets_each_slower_rank_its_slowdown_and_the_cli_ranks_take_it(monkeypatch):
    """Under "dilate" a rank of share s < 1 is told 1 / s; whole cores and the other modes are told
    nothing (a slowdown left in the launcher's own environment is not passed on); a Galaxy CLI rank
    runs its work inside the stretching mode; a bad value is one line naming the variable."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from galaxy.cli.launch import Launch, run_rank
    from galaxy.emulate.cluster import SLOWDOWN_ENV
    from galaxy.emulate.slowdown import StretchOps, slowdown_from_env

    cluster = Cluster.from_dict({"ranks": [{"compute_share": 0.25}, {"compute_share": 1.0}, {}],
                                 "cpu_emulation": "dilate"})
    assert [cluster.slowdown(r) for r in range(3)] == [4.0, 1.0, 1.0]
    emu = EmulatedCluster(cluster)
    assert emu.rank_env(0, {})[SLOWDOWN_ENV] == "4" and SLOWDOWN_ENV not in emu.rank_env(1, {SLOWDOWN_ENV: "3"})
    cores = EmulatedCluster(Cluster.from_dict({"ranks": [{"compute_share": 0.25}]}))
    assert cores.cluster.slowdown(0) == 1.0 and SLOWDOWN_ENV not in cores.rank_env(0, {})

    seen = []
    monkeypatch.setenv(SLOWDOWN_ENV, "3")
    assert run_rank(lambda *_: seen.append(_get_current_dispatch_mode()), 0, Launch(1, 0, None, None), None) == 0
    assert isinstance(seen[0], StretchOps) and seen[0].extra == 2.0
    monkeypatch.delenv(SLOWDOWN_ENV)
    assert run_rank(lambda *_: seen.append(_get_current_dispatch_mode()), 0, Launch(1, 0, None, None), None) == 0
    assert seen[1] is None
    for bad in ("fast", "0.5", "nan"):
        with pytest.raises(ConfigError, match=f"{SLOWDOWN_ENV}='{bad}' must be a number from 1"):
            slowdown_from_env({SLOWDOWN_ENV: bad})


def test_stretch_waits_factor_minus_one_times_each_compute_op_and_not_collectives(tmp_path):
    """Under a slowdown of 3 every compute op, backward's too, is followed by a wait of exactly twice
    what it took; a Gloo all-reduce gets none (the emulated link times it). A fake clock, on which
    each op takes 4 ms, and a recorded wait make this independent of the machine's load; what the
    stretch measures in wall time is bench/bench_share.py's (mode "dilate")."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from galaxy.emulate.slowdown import StretchOps

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.namespaces = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.namespaces.append(func.namespace)
            return func(*args, **(kwargs or {}))

    reads, waits = [], []

    def clock():  # each read 4 ms after the one before: nothing else reads it, so an op takes 4 ms
        reads.append(len(reads) * 0.004)
        return reads[-1]

    def wait_until(until):  # recorded, not waited: how long after the op's end
        waits.append(until - reads[-1])

    a = torch.randn(8, 8, requires_grad=True)

    def work():
        a.grad = None
        torch.tanh(a @ a).sum().backward()
        dist.all_reduce(a.grad)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with Dispatched() as seen:
            work()
        with StretchOps(3.0, clock=clock, wait_until=wait_until):
            work()
    finally:
        dist.destroy_process_group()
    compute = [n for n in seen.namespaces if n != "c10d"]
    assert "c10d" in seen.namespaces and len(compute) >= 6, seen.namespaces  # mm, tanh, sum and their backward
    assert waits == [pytest.approx(2 * 0.004, abs=1e-12)] * len(compute), (waits, seen.namespaces)


def test_wait_until_sleeps_most_of_the_way_and_spins_the_rest():
    """The wait after a stretched op sleeps (freeing the core for the rank's communication threads)
    all but the last _SPIN_S, then spins to the deadline (a sleep overshoots); short waits only spin."""
    from galaxy.emulate.slowdown import _SPIN_S, wait_until

    now, slept = [0.0], []

    def clock():  # every read 10 us later, as a spin loop sees it
        now[0] += 1e-5
        return now[0]

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    wait_until(0.050, clock, sleep)
    assert slept == [pytest.approx(0.050 - 1e-5 - _SPIN_S)] and 0.050 <= now[0] < 0.050 + 2e-5, (slept, now)
    slept.clear()
    wait_until(now[0] + 1.5 * _SPIN_S, clock, sleep)
    assert slept == [] and now[0] >= 0.050 + 1.5 * _SPIN_S
    before = now[0]
    wait_until(before - 1.0, clock, sleep)  # already past: returns at once (two reads)
    assert slept == [] and now[0] == pytest.approx(before + 2e-5)


@needs_host
@pytest.mark.parametrize("emulation", ["quota", "cores", "dilate"])
def test_links_and_cpu_limits_are_where_the_file_says(emulation):
    cluster = Cluster.from_dict({"ranks": [{"compute_share": 0.5, "bandwidth_mbit": 20}, {}],
                                 "links": {"bandwidth_mbit": 100}, "cpu_period_us": 20000,
                                 "cpu_emulation": emulation})
    with EmulatedCluster(cluster) as emu:
        switch = network.switch_namespace(emu.name)
        for rank, rate in [(0, "20Mbit"), (1, "100Mbit")]:
            ns = network.rank_namespace(emu.name, rank)
            for where, dev in [(ns, network.RANK_INTERFACE), (switch, f"port{rank}")]:
                shown = subprocess.run(["tc", "-n", where, "qdisc", "show", "dev", dev], capture_output=True,
                                       text=True, check=True).stdout
                assert "tbf" in shown and f"rate {rate}" in shown, (where, dev, shown)
        # What a share is made of (how fast a rank then runs, after waits too, is bench/bench_share.py's
        # to measure): a quota of half the period under "quota"; under "cores" half a core's weight, a
        # filler with the other half on the rank's own core.
        group = cgroups.rank_group(emu.name, 0)
        assert open(f"{group}/cpu.cfs_quota_us").read().strip() == ("10000" if emulation == "quota" else "-1")
        assert open(f"{group}/cpu.cfs_period_us").read().strip() == "20000"
        weight = cgroups.CORE_WEIGHT // (2 if emulation == "cores" else 1)
        assert open(f"{group}/cpu.shares").read().strip() == str(weight)
        assert open(f"{cgroups.rank_group(emu.name, 1)}/cpu.cfs_quota_us").read().strip() == "-1"
        env = emu.rank_env(1, {})
        assert env["MASTER_ADDR"] == "10.200.0.1" and env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
        seen = emu.spawn(0, ["sh", "-c", "ip -4 -o addr show gxlink; cat /proc/self/cgroup; grep Cpus_allowed_list "
                                         "/proc/self/status"], stdout=subprocess.PIPE,
                         text=True).communicate(timeout=HANG_GUARD_S)[0]
        assert "10.200.0.1/16" in seen and f"cpu:/{emu.name}/rank0" in seen, seen
        cpus = re.search(r"Cpus_allowed_list:\s*(\S+)", seen).group(1)
        fillers = [f for f in os.listdir(cgroups.run_group(emu.name)) if f.startswith("filler")]
        if emulation == "dilate":  # a core of its own, no filler, told to stretch its ops by 2
            assert cpus.isdigit() and fillers == [] and emu.rank_env(0, {})["GALAXY_EMULATE_SLOWDOWN"] == "2"
        elif emulation == "cores":  # pinned to one core, a filler of the other half beside it
            assert cpus.isdigit() and fillers == [f"filler{cpus}"], (cpus, fillers)
            filler = cgroups.filler_group(emu.name, int(cpus))
            assert open(f"{filler}/cpu.shares").read().strip() == str(cgroups.CORE_WEIGHT // 2)
            (busy,) = cgroups.members(filler)
            assert os.sched_getaffinity(busy) == {int(cpus)}  # the rank's core, not another
        else:
            assert fillers == [] and cpus == ",".join(map(str, sorted(os.sched_getaffinity(0)))).replace("0,1", "0-1")
    assert leftovers(emu.name) == []


@needs_host
def test_a_process_that_cannot_join_its_group_is_reported_not_waited_for(tmp_path):
    """``__enter__`` waits until each filler is in its cgroup (it joins after Popen returns: a run read its
    group empty once); one that exits first, here because its group does not exist, is an error at once
    (the error of its exit, not of the wait running out)."""
    emu = EmulatedCluster(Cluster.from_dict({"ranks": [{}, {}]}))
    missing = str(tmp_path / "no-such-group")
    proc = emu._start(missing, None, ["sleep", "5"], stderr=subprocess.DEVNULL)
    with pytest.raises(RuntimeError, match="exited \\(code 126\\) before joining it"):
        _wait_joined(proc, missing)


# ----------------------------------------------------------------------------- cleanup on every exit path


def leftovers(name: str) -> list[str]:
    """What the emulated run `name` still holds on this machine."""
    found = [ns for ns in network.list_namespaces() if ns.startswith(name)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found += [line for line in links.splitlines() if name in line or "gxlink" in line]
    found += [p for p in (cgroups.run_group(name), os.path.join(LOCK_DIR, f"{name}.lock")) if os.path.exists(p)]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_name(text: str) -> str:
    match = re.search(r"emulated cluster (galaxy-emu-[0-9a-f]{8}): rank 0", text)  # the line saying it is up
    assert match, text
    return match.group(1)


TWO = Cluster.from_dict({"ranks": [{"compute_share": 1.0}, {"compute_share": 0.5}], "links": {"bandwidth_mbit": 100}})


@needs_host
def test_cleanup_after_success_and_after_a_failing_rank(caplog):
    with caplog.at_level(logging.INFO, logger="galaxy.emulate"):
        assert run_emulated(TWO, lambda rank: ["sh", "-c", f"test $RANK = {rank}"]) == 0
    assert leftovers(run_name(caplog.text)) == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="galaxy.emulate"):
        assert run_emulated(TWO, lambda rank: ["sh", "-c", f"exit {3 * rank}"]) == 3
    assert "rank 1 exited with code 3" in caplog.text
    assert leftovers(run_name(caplog.text)) == []


@needs_host
def test_cleanup_after_an_exception_kills_the_ranks():
    with pytest.raises(ZeroDivisionError):
        with EmulatedCluster(TWO) as emu:
            procs = [emu.spawn(r, ["sleep", "60"]) for r in range(2)]
            1 / 0
    assert not any(alive(p.pid) for p in procs)
    assert leftovers(emu.name) == []


@needs_host
def test_cleanup_after_a_rank_is_sigkilled(tmp_path, caplog):
    """Rank 1 dies by SIGKILL; rank 0 ignores SIGTERM and has a child of its own: the launcher names
    rank 1, returns 128 + 9, and SIGKILLs all of rank 0's cgroup after the grace period (rank 0 never
    gets to say that its child ended)."""
    pidfile, ended = tmp_path / "grandchild", tmp_path / "rank0_ended"
    argv = {0: ["sh", "-c", f"trap '' TERM; sleep 60 & echo $! > {pidfile}; wait; touch {ended}"],
            1: ["sh", "-c", f"while [ ! -s {pidfile} ]; do sleep 0.05; done; kill -9 $$"]}
    with caplog.at_level(logging.INFO, logger="galaxy.emulate"):
        code = run_emulated(TWO, argv.__getitem__, grace_s=0.5)
    assert code == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in caplog.text
    assert not alive(int(pidfile.read_text())) and not ended.exists()
    assert leftovers(run_name(caplog.text)) == []


@needs_host
def test_cleanup_when_building_fails():
    """tc refuses this rate (the cluster file's validation would have refused it too): the half-built
    cluster is removed and the tool's error comes through. (Its own name is looked for: another run on the
    machine, a colleague's test, may be up meanwhile.)"""
    emu = EmulatedCluster(Cluster(ranks=(RankSpec(None, None), RankSpec(None, 1e15))))
    with pytest.raises(HostCommandError, match="tbf"):
        with emu:
            pass
    assert NAME_PATTERN.fullmatch(emu.name) and leftovers(emu.name) == []


def start_launcher(tmp_path, *command):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"ranks": [{}, {"compute_share": 0.5}], "links": {"bandwidth_mbit": 100}}))
    launcher = subprocess.Popen([sys.executable, "-m", "galaxy.emulate", str(cluster), "--grace", "1", "--", *command],
                                stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    lines = []
    while not lines or "rank 0" not in lines[-1]:  # skip other lines, e.g. about removed leftovers
        lines.append(launcher.stderr.readline())
        assert lines[-1], f"the launcher ended: {''.join(lines)}"
    name = run_name(lines[-1])
    deadline = time.monotonic() + 300  # a hang guard: starting `sleep` takes a busy host seconds, not minutes
    while not all(cgroups.members(cgroups.rank_group(name, r)) for r in range(2)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.02)
    ranks = [pid for r in range(2) for pid in cgroups.members(cgroups.rank_group(name, r))]
    return launcher, name, ranks


@needs_host
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_after_sigterm_or_ctrl_c_of_the_launcher(tmp_path, signum):
    launcher, name, ranks = start_launcher(tmp_path, "sleep", "60")
    launcher.send_signal(signum)
    assert launcher.wait(timeout=HANG_GUARD_S) == 128 + signum
    assert f"the launcher got {signum.name}" in launcher.stderr.read()
    assert not any(alive(pid) for pid in ranks)
    assert leftovers(name) == []


@needs_host
def test_a_sigkilled_launcher_takes_its_ranks_along_and_the_next_run_removes_its_leftovers(tmp_path):
    launcher, name, ranks = start_launcher(tmp_path, "sleep", "60")
    launcher.kill()
    launcher.wait(timeout=HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S  # the kernel kills them as the launcher dies
    while any(alive(pid) for pid in ranks):  # --pdeathsig KILL
        assert time.monotonic() < deadline, "ranks outlived their launcher"
        time.sleep(0.02)
    assert leftovers(name) != []  # nobody was left to clean up ...
    remove_stale_runs()  # ... until the next run looks
    assert leftovers(name) == []


@needs_host
def test_training_cli_runs_every_rank_in_the_emulated_cluster(tmp_path):
    """``pretrain_galaxy.py --emulate cluster.json``: both ranks start in their namespaces (the Galaxy plan
    trains across the shaped link) and nothing of the run is left afterwards."""
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"ranks": [{"compute_share": 1.0}, {"compute_share": 0.5}],
                                   "links": {"bandwidth_mbit": 100}}))
    summary = tmp_path / "summary.json"
    out = subprocess.run([sys.executable, "pretrain_galaxy.py", "--emulate", str(cluster), "--max_steps", "2",
                          "--no_progress", "--summary_json", str(summary), "--log_level", "INFO"],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                         timeout=2 * HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    fields = json.loads(summary.read_text())
    assert fields["world"] == 2 and fields["plan"] == "galaxy" and fields["steps"] == 2
    assert leftovers(run_name(out.stderr)) == []  # namespaces, links, cgroups and the lock of the run are gone


def test_training_cli_refuses_emulate_with_rank_or_another_world(tmp_path):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"ranks": [{"compute_share": 1.0}, {"compute_share": 0.5}]}))
    for extra, says in ((["--rank", "0", "--world", "2"], "drop --rank"), (["--world", "3"], "disagrees")):
        # in this process (tests.in_process): refused before any rank or emulated host starts
        out = run_script(["pretrain_galaxy.py", "--emulate", str(cluster), *extra], timeout=HANG_GUARD_S)
        assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_plan_on_some_devices_starts_there():
    """A planned config naming devices (key 'devices') runs on those ranks of the emulated cluster only."""
    from galaxy.cli.launch import Launch, on_devices

    cluster = Cluster.from_dict({"ranks": [{"compute_share": 0.5}, {"compute_share": 1.0, "bandwidth_mbit": 50},
                                           {"compute_share": 1.5}], "links": {"bandwidth_mbit": 100}})
    launch = on_devices(Launch(3, None, None, None, emulate=cluster), [2, 1])
    assert launch.world == 2 and launch.emulate.ranks == (cluster.ranks[2], cluster.ranks[1])
    with pytest.raises(ConfigError, match="'devices' names rank 3"):
        on_devices(Launch(3, None, None, None, emulate=cluster), [3])
    with pytest.raises(ConfigError, match="start 1 ranks"):
        on_devices(Launch(2, None, None, None), [1])
    plain = Launch(2, None, None, None)
    assert on_devices(plain, None) is plain and on_devices(plain, [0, 1]) is plain
