"""A sandbox's network: its own namespace, joined to this machine by a veth pair on a /30 link,
and the pair's direct cable to one other sandbox.

Sandbox index N gets the link 10.233.N.0/30: this machine's side is interface PREFIX + N with
10.233.N.1, the guest's side is `eth0` with 10.233.N.2 and a default route via 10.233.N.1.
`addresses` is the one place those addresses are made.

The cable (`sparkform sandbox --name A link B`) stands in for the ConnectX-7 link of two Sparks:
a veth pair straight from A's namespace to B's, interface CABLE_INTERFACE in both guests, MTU
CABLE_MTU (the Sparks' jumbo frames), on 10.234.K.0/30 where K is A's index: A holds 10.234.K.1,
B 10.234.K.2 (`cable_addresses`, the one place they are made). A sandbox has one cable at most,
so no two cables share a K; nothing on this machine routes to them (the ranks talk only over the
cable). Each side's runtime folder records it in CABLE_RECORD, which `down` of either reads to
remove it; the namespaces outlive a guest's reboot, and the cable with them.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from sparkform.sandbox.registry import NAME_PATTERN, PREFIX, system_name
from sparkform.sandbox.system import SandboxError, run_step

NETNS_DIR = Path("/run/netns")
GUEST_INTERFACE = "eth0"
LINK_PREFIX_LENGTH = 30
CABLE_INTERFACE = "cx7"
CABLE_MTU = 9000
CABLE_NETWORK = ipaddress.ip_network("10.234.0.0/16")  # beside the links' 10.233.0.0/16, never inside it
CABLE_RECORD = "cable"


def addresses(index: int) -> tuple[str, str]:
    """(this machine's side, the guest's side) of link `index`: 10.233.N.1 and 10.233.N.2."""
    return f"10.233.{index}.1", f"10.233.{index}.2"


def cable_addresses(index: int) -> tuple[str, str]:
    """(the linking sandbox's side, its peer's side) of cable `index`: 10.234.K.1 and 10.234.K.2."""
    return f"10.234.{index}.1", f"10.234.{index}.2"


@dataclass(frozen=True)
class Cable:
    """One side's view of the pair's cable: the peer sandbox and both ends' addresses on CABLE_INTERFACE."""

    peer: str
    address: str
    peer_address: str

    def __str__(self) -> str:
        ends = f"{self.address}/{LINK_PREFIX_LENGTH} <-> {self.peer} {self.peer_address}"
        return f"{CABLE_INTERFACE} {ends} (mtu {CABLE_MTU})"

    def seen_from_peer(self, name: str) -> Cable:
        """The same cable as the peer records it (`name`: this side's sandbox)."""
        return Cable(peer=name, address=self.peer_address, peer_address=self.address)


def cable_steps(name: str, peer: str, index: int) -> list[tuple[str, list[str]]]:
    """(step, command) pairs that lay cable `index` from sandbox `name` to `peer`: the veth pair
    made with one end in each namespace (never on this machine), MTU CABLE_MTU, addressed, up."""
    ends = list(zip((netns_name(name), netns_name(peer)), cable_addresses(index), strict=True))
    (here, _), (there, _) = ends
    mtu = ["mtu", str(CABLE_MTU)]
    lay = ["ip", "-n", here, "link", "add", CABLE_INTERFACE, *mtu, "type", "veth"]
    steps = [("lay the cable", [*lay, "peer", "name", CABLE_INTERFACE, *mtu, "netns", there])]
    for netns, address in ends:
        steps.append(
            (
                f"address the cable in {netns}",
                ["ip", "-n", netns, "addr", "add", f"{address}/{LINK_PREFIX_LENGTH}", "dev", CABLE_INTERFACE],
            )
        )
    for netns, _ in ends:
        steps.append((f"bring the cable up in {netns}", ["ip", "-n", netns, "link", "set", CABLE_INTERFACE, "up"]))
    return steps


def lay_cable(name: str, peer: str, index: int) -> Cable:
    """Lay cable `index` from sandbox `name` to `peer` (both namespaces exist); returns `name`'s view."""
    for step, command in cable_steps(name, peer, index):
        run_step(step, command)
    here, there = cable_addresses(index)
    return Cable(peer=peer, address=here, peer_address=there)


def has_cable(name: str) -> bool:
    """Whether CABLE_INTERFACE exists in sandbox `name`'s namespace."""
    if not netns_path(name).exists():
        return False
    listing = run_step("list the guest's interfaces", ["ip", "-n", netns_name(name), "-o", "link", "show"]).stdout
    # Lines like "5: cx7@if4: <BROADCAST,...> mtu 9000 ...".
    return any(line.split(":")[1].strip().split("@")[0] == CABLE_INTERFACE for line in listing.splitlines())


def cut_cable(name: str) -> None:
    """Remove sandbox `name`'s cable if it has one (the peer's end goes with it)."""
    if has_cable(name):
        run_step("cut the cable", ["ip", "-n", netns_name(name), "link", "del", CABLE_INTERFACE])


def read_cable(runtime_dir: Path) -> Cable | None:
    """The cable recorded in a sandbox's runtime folder (None without one), its values checked."""
    path = runtime_dir / CABLE_RECORD
    try:
        data = json.loads(path.read_text())
        cable = Cable(peer=str(data["peer"]), address=str(data["address"]), peer_address=str(data["peer_address"]))
        valid = bool(NAME_PATTERN.fullmatch(cable.peer)) and all(
            ipaddress.ip_address(address) in CABLE_NETWORK for address in (cable.address, cable.peer_address)
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise SandboxError(f"{path} is not a cable record sparkform wrote: `down` this sandbox and its peer")
    return cable


def write_cable(runtime_dir: Path, cable: Cable) -> None:
    """Record `cable` in a sandbox's runtime folder."""
    (runtime_dir / CABLE_RECORD).write_text(json.dumps(asdict(cable)) + "\n")


def netns_name(name: str) -> str:
    """The network namespace of sandbox `name`."""
    return system_name(name)


def netns_path(name: str) -> Path:
    """The network namespace of sandbox `name` as a file (what systemd-nspawn joins)."""
    return NETNS_DIR / netns_name(name)


def create_network(name: str, index: int) -> None:
    """A netns with a veth pair: this machine's side `sfsb-N` 10.233.N.1/30, guest `eth0` 10.233.N.2/30."""
    netns, host_if = netns_name(name), f"{PREFIX}{index}"
    host_side, guest_side = addresses(index)
    run_step("create the network namespace", ["ip", "netns", "add", netns])
    run_step(
        "create the veth pair",
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", GUEST_INTERFACE, "netns", netns],
    )
    run_step("address the host side", ["ip", "addr", "add", f"{host_side}/{LINK_PREFIX_LENGTH}", "dev", host_if])
    run_step("bring the host side up", ["ip", "link", "set", host_if, "up"])
    # Configured from here, so the guest needs no network configuration (and no networkd).
    guest = ["ip", "-n", netns]
    run_step("bring the guest's lo up", [*guest, "link", "set", "lo", "up"])
    run_step(
        "address the guest side", [*guest, "addr", "add", f"{guest_side}/{LINK_PREFIX_LENGTH}", "dev", GUEST_INTERFACE]
    )
    run_step("bring the guest side up", [*guest, "link", "set", GUEST_INTERFACE, "up"])
    run_step("route the guest via the host", [*guest, "route", "add", "default", "via", host_side])


def delete_network(name: str) -> None:
    """Delete the netns of sandbox `name` if it exists, its link first: the kernel frees a deleted
    namespace's interfaces later, on its own, and the next `up` may take this link's index (and
    its name on this machine's side) before that."""
    if not netns_path(name).exists():
        return
    netns = netns_name(name)
    link = subprocess.run(["ip", "-n", netns, "link", "show", GUEST_INTERFACE], capture_output=True, check=False)
    if link.returncode == 0:
        run_step("delete the link", ["ip", "-n", netns, "link", "del", GUEST_INTERFACE])  # both ends, at once
    run_step("delete the network namespace", ["ip", "netns", "del", netns])
