"""The sandbox host for real: a Debian rootfs booted with systemd-nspawn, reached over SSH.

Needs root, debootstrap, systemd-container and a Debian mirror in the apt sources. The first
run builds the rootfs (~1.5 min); after that each test boots its own sandbox in about a second.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from deploy_helpers import wait_for
from suite_hygiene import sandbox_name

from sparkform import cli
from sparkform.sandbox import machine, network, nspawn, registry, stage, system
from sparkform.sandbox.machine import Sandbox
from sparkform.sandbox.rootfs import BASE_PACKAGES, apt_mirror, build_rootfs, rootfs_key
from sparkform.sandbox.system import SandboxError

# The rootfs the rehearsal stage boots (sparkform.sandbox.stage): one build serves both suites.
CI_MINUTES = 2  # wall time in CI, its sandbox setups included (the table at the end of `make test`)
STAGE_PACKAGES = stage.STAGE_PACKAGES


@pytest.fixture(scope="module")
def rootfs() -> Path:
    """The cached rootfs (built once; the time is printed)."""
    started = time.monotonic()
    path = build_rootfs(STAGE_PACKAGES)
    print(f"\nrootfs {path} ready in {time.monotonic() - started:.1f} s")
    return path


@pytest.fixture
def make_sandbox(rootfs: Path) -> Iterator[Callable[..., Sandbox]]:
    """Brings sandboxes up under unique names; takes every one down after the test."""
    made: list[str] = []

    def _make(**kwargs: object) -> Sandbox:
        name = sandbox_name()
        made.append(name)
        return machine.up(name, extra_packages=STAGE_PACKAGES, **kwargs)

    yield _make
    for name in made:
        machine.down(name)


def ssh(sandbox: Sandbox, command: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `command` in the guest with the sandbox's own ssh_config (no prompts: BatchMode)."""
    argv = [*sandbox.ssh_args(), *extra, command]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


def traces(sandbox: Sandbox) -> dict[str, object]:
    """What a sandbox leaves on this machine; collected while it is up, checked after `down`."""
    rt = sandbox.runtime_dir
    cgroups = [Path(line) for line in (rt / "cgroups").read_text().split()]
    pids = {int(p) for folder in cgroups for f in folder.rglob("cgroup.procs") for p in f.read_text().split()}
    return {
        "rt": rt,
        "layers": Path((rt / "layers").read_text().strip()),
        "cgroups": cgroups,
        "pids": pids,
        "netns": network.netns_name(sandbox.name),
        "host_if": f"sfsb-{sandbox.address.split('.')[2]}",
    }


def leftovers(found: dict[str, object]) -> list[str]:
    """Everything of a sandbox that is still there (should be [] after `down`)."""
    rt, layers = found["rt"], found["layers"]
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    left = [line for line in mounts if str(rt) in line or str(layers) in line]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    left += [f"netns {found['netns']}"] if found["netns"] in netns else []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    left += [f"link {found['host_if']}"] if f" {found['host_if']}@" in links or f" {found['host_if']}:" in links else []
    left += [f"cgroup {folder}" for folder in found["cgroups"] if folder.exists()]
    left += [f"pid {pid}" for pid in found["pids"] if system.alive(pid)]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            root = os.readlink(proc / "root")
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone, or a zombie (this machine's PID 1 reaps orphans lazily)
        if root.startswith(str(rt)) or str(rt) in cmdline:
            left.append(f"process {proc.name}: {cmdline!r}")
    left += [str(p) for p in (rt, layers, nspawn.NSPAWN_RUN / "propagate" / f"sfsb-{rt.name}") if p.exists()]
    return left


@contextlib.contextmanager
def serving(address: str, directory: Path) -> Iterator[int]:
    """An HTTP server for `directory` on `address` (a free port, yielded) while the block runs."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer((address, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_up_boots_real_systemd_reachable_by_ssh(make_sandbox: Callable[..., Sandbox], tmp_path: Path) -> None:
    (tmp_path / "hello.txt").write_text("from the host\n")
    sandbox = make_sandbox(binds=[(str(tmp_path), "/mnt/shared")])
    # A figure, not a bound: under make test's parallel workers a boot takes 2-7 s here.
    print(f"up took {sandbox.up_seconds:.2f} s")
    assert ssh(sandbox, "systemctl is-system-running").stdout.strip() in ("running", "degraded")
    assert ssh(sandbox, "cat /proc/1/comm").stdout.strip() == "systemd"
    assert ssh(sandbox, "ip -4 -o addr show eth0").stdout.split()[3] == f"{sandbox.address}/30"
    assert ssh(sandbox, "cat /mnt/shared/hello.txt").stdout == "from the host\n"
    assert ssh(sandbox, "touch /mnt/shared/x", check=False).returncode != 0  # bound read-only
    with serving(sandbox.host_address, tmp_path) as port:  # the guest reaches this machine's services
        assert ssh(sandbox, f"curl -sf http://{sandbox.host_address}:{port}/hello.txt").stdout == "from the host\n"
    assert machine.status(sandbox.name)["state"] in ("running", "degraded")
    assert sandbox.name in registry.names()


def test_strict_host_key_checking(make_sandbox: Callable[..., Sandbox], tmp_path: Path) -> None:
    sandbox = make_sandbox()
    assert sandbox.known_hosts.read_text().startswith(f"{sandbox.address} ssh-ed25519 ")
    # A fresh connection (no control master) with the written files needs no prompt...
    no_mux = ("-o", "ControlPath=none")
    assert ssh(sandbox, "true", *no_mux).returncode == 0
    # ...and one that expects another host key is refused.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()[:2]
    (tmp_path / "known_hosts").write_text(f"{sandbox.address} {' '.join(other)}\n")
    refused = ssh(sandbox, "true", *no_mux, "-o", f"UserKnownHostsFile={tmp_path / 'known_hosts'}", check=False)
    assert refused.returncode == 255 and "Host key verification failed" in refused.stderr


def test_two_sandboxes_run_at_once(make_sandbox: Callable[..., Sandbox]) -> None:
    first, second = make_sandbox(), make_sandbox()
    assert first.address != second.address
    for sandbox in (first, second):
        assert ssh(sandbox, "hostname").stdout.strip() == sandbox.name
        assert sandbox.name in registry.names()


def test_up_of_a_name_that_is_up_is_an_error(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    with pytest.raises(SandboxError, match="already up"):
        machine.up(sandbox.name)
    assert ssh(sandbox, "true").returncode == 0


def test_down_leaves_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    ssh(sandbox, "true")  # a control master runs now
    found = traces(sandbox)
    started = time.monotonic()
    machine.down(sandbox.name)
    print(f"down took {time.monotonic() - started:.2f} s")
    assert leftovers(found) == []
    assert sandbox.name not in registry.names()
    assert machine.status(sandbox.name)["up"] is False
    machine.down(sandbox.name)  # again: a no-op
    machine.down("never-was-up")


def test_down_after_nspawn_was_killed_leaves_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    found = traces(sandbox)
    pid = machine.status(sandbox.name)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "systemd-nspawn gone after SIGKILL")
    assert machine.status(sandbox.name)["up"] is False
    machine.down(sandbox.name)
    assert leftovers(found) == []


def test_reboot_brings_the_same_sandbox_back(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    ssh(sandbox, "echo before-reboot > /root/marker")
    host_key = ssh(sandbox, "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout
    pid_before = machine.status(sandbox.name)["pid"]
    seconds = machine.reboot(sandbox.name)
    print(f"reboot took {seconds:.2f} s")
    after = machine.status(sandbox.name)
    assert after["up"] and after["pid"] != pid_before and after["address"] == sandbox.address
    # Strict host key checking passes with the known_hosts written at `up`: same host key.
    assert ssh(sandbox, "cat /etc/ssh/ssh_host_ed25519_key.pub", "-o", "ControlPath=none").stdout == host_key
    assert ssh(sandbox, "cat /root/marker").stdout == "before-reboot\n"
    assert ssh(sandbox, "systemctl is-system-running").stdout.strip() in ("running", "degraded")


def test_reboot_waits_for_boot_start_jobs_and_names_the_one_it_outlasts(make_sandbox: Callable[..., Sandbox]) -> None:
    # An enabled unit whose start takes 30 s, as an engine's does until readiness: the boot
    # (and so the reboot) is over only when it started.
    sandbox = make_sandbox()
    ssh(
        sandbox,
        "printf '%s\\n' '[Service]' 'Type=oneshot' 'ExecStart=/bin/sleep 30' '[Install]' "
        "'WantedBy=multi-user.target' > /etc/systemd/system/slow-start.service "
        "&& systemctl enable slow-start.service",
    )
    with pytest.raises(SandboxError, match=r"systemd still starting units; jobs: .*slow-start\.service") as err:
        machine.reboot(sandbox.name, timeout=10)
    print(err.value)
    seconds = machine.reboot(sandbox.name)
    assert seconds >= 30, f"reboot returned after {seconds:.1f} s, before slow-start.service finished"
    finished = ssh(sandbox, "systemctl show -P ExecMainExitTimestampMonotonic slow-start.service").stdout.strip()
    assert int(finished) > 0, "slow-start.service had not finished when reboot() returned"


# A jumbo "ping" over the cable (the guest has no ping; python3 it has): the sender forbids
# fragmentation and sends one datagram that fills a 9000-byte frame (less 20 bytes IP, 8 UDP); the
# peer's listener answers with the size it got. A 1500 MTU on either end loses it.
JUMBO_PAYLOAD = network.CABLE_MTU - 28
ECHO_PORT = 9000
LISTEN = (
    "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); data, sender = s.recvfrom(65535)\n"
    "s.sendto(str(len(data)).encode(), sender)"
)
SEND = (
    "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)\n"
    "s.setsockopt(socket.IPPROTO_IP, 10, 2)\n"  # Linux's IP_MTU_DISCOVER = IP_PMTUDISC_DO (Python names neither)
    "s.sendto(b'x' * int(sys.argv[3]), (sys.argv[1], int(sys.argv[2]))); print(s.recv(64).decode())"
)


def jumbo_ping(sender: Sandbox, receiver: Sandbox, address: str) -> str:
    """What `receiver`'s echo (listening on `address`) answers `sender`'s jumbo datagram: its size."""
    listen = shlex.join(["python3", "-c", LISTEN, address, str(ECHO_PORT)])
    ssh(receiver, f"systemd-run --collect --unit=cable-echo {listen}")
    send = shlex.join(["python3", "-c", SEND, address, str(ECHO_PORT), str(JUMBO_PAYLOAD)])
    bound = f"ss -Hlun 'sport = :{ECHO_PORT}'"
    wait_for(lambda: ssh(receiver, bound).stdout.strip(), 30, f"the echo listening on {address}:{ECHO_PORT}")
    answer = ssh(sender, send, check=False)
    return answer.stdout.strip() if answer.returncode == 0 else answer.stderr.strip()


def cable_seen_in(sandbox: Sandbox) -> tuple[str, str, str]:
    """(MTU by netlink, MTU in sysfs, address/prefix) of the guest's cable interface, as the guest
    reads them (the preflight reads sysfs)."""
    link = ssh(sandbox, f"ip -o link show dev {network.CABLE_INTERFACE}").stdout.split()
    sysfs = ssh(sandbox, f"cat /sys/class/net/{network.CABLE_INTERFACE}/mtu").stdout.strip()
    address = ssh(sandbox, f"ip -4 -o addr show dev {network.CABLE_INTERFACE}").stdout.split()[3]
    return link[link.index("mtu") + 1], sysfs, address


def test_the_pair_s_cable_joins_two_sandboxes_through_a_reboot_until_down(
    make_sandbox: Callable[..., Sandbox], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = make_sandbox(), make_sandbox()
    found = [traces(a), traces(b)]
    assert cli.main(["sandbox", "--name", a.name, "link", b.name]) == 0
    cable = network.read_cable(a.runtime_dir)
    assert (cable.address, cable.peer_address) == network.cable_addresses(registry.read_index(a.runtime_dir))
    assert capsys.readouterr().out.strip() == str(cable)
    # Linking again, either way round, changes nothing.
    assert machine.link(a.name, b.name) == cable
    assert machine.link(b.name, a.name) == cable.seen_from_peer(a.name) == network.read_cable(b.runtime_dir)
    assert cable_seen_in(a) == ("9000", "9000", f"{cable.address}/30")
    assert cable_seen_in(b) == ("9000", "9000", f"{cable.peer_address}/30")
    # The guest's sysfs is its namespace's, as on a host: its own interfaces, none of this machine's.
    assert ssh(a, "ls /sys/class/net").stdout.split() == sorted([network.CABLE_INTERFACE, "eth0", "lo"])
    assert machine.status(b.name)["cable"] == {
        "peer": a.name,
        "address": cable.peer_address,
        "peer_address": cable.address,
    }
    assert jumbo_ping(a, b, cable.peer_address) == str(JUMBO_PAYLOAD)
    # The ranks' traffic takes the cable; this machine has no address or route on it.
    assert f"dev {network.CABLE_INTERFACE}" in ssh(a, f"ip route get {cable.peer_address}").stdout
    assert "10.234." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    # The namespace outlives the guest's reboot, and the cable with it.
    machine.reboot(b.name)
    assert cable_seen_in(b) == ("9000", "9000", f"{cable.peer_address}/30")
    assert jumbo_ping(a, b, cable.peer_address) == str(JUMBO_PAYLOAD)
    # `down` of either side removes the cable and the other side's record of it.
    machine.down(a.name)
    assert f" {network.CABLE_INTERFACE}@" not in ssh(b, "ip -o link").stdout
    assert machine.status(b.name)["cable"] is None and network.read_cable(b.runtime_dir) is None
    machine.down(b.name)
    assert [leftovers(box) for box in found] == [[], []]
    assert not {a.name, b.name} & set(registry.names())


def test_memory_max_is_enforced_once_the_controller_is_writable(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    machine.memory_controller_writable(sandbox.name)
    assert_memory_max_kills(sandbox)
    machine.reboot(sandbox.name)  # mounts the controller read-only again; reboot() makes it writable again
    assert_memory_max_kills(sandbox)


def assert_memory_max_kills(sandbox: Sandbox) -> None:
    """A unit with MemoryMax=50M that allocates 200 MiB is killed."""
    hog = "python3 -c 'x=bytearray(200*2**20); import time; time.sleep(5)'"
    run = ssh(sandbox, f"systemd-run --wait --collect -p MemoryMax=50M {hog}", check=False)
    assert run.returncode != 0
    assert "Finished with result: signal" in run.stderr or "Finished with result: oom-kill" in run.stderr, run.stderr


def test_apt_mirror_reads_both_source_formats(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    with pytest.raises(SandboxError, match="no apt source"):
        apt_mirror(apt_dir=tmp_path)
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm-updates main\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb deb-src\n# a comment\nURIs: http://two.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert apt_mirror(apt_dir=tmp_path) == "http://two.example/debian"
    (tmp_path / "sources.list").write_text("deb http://one.example/debian bookworm main contrib\n")
    assert apt_mirror(apt_dir=tmp_path) == "http://one.example/debian"


def test_rootfs_key_depends_on_the_package_list() -> None:
    base = rootfs_key(BASE_PACKAGES)
    assert rootfs_key(reversed(BASE_PACKAGES)) == base
    assert rootfs_key([*BASE_PACKAGES, "jq"]) != base
