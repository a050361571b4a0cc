"""A sandbox's network: its own namespace, joined to this machine by a veth pair on a /30 link.

Sandbox index N gets the link 10.233.N.0/30: this machine's side is interface PREFIX + N with
10.233.N.1, the guest's side is `eth0` with 10.233.N.2 and a default route via 10.233.N.1.
`addresses` is the one place those addresses are made.
"""

from __future__ import annotations

from pathlib import Path

from sparkform.sandbox.registry import PREFIX, system_name
from sparkform.sandbox.system import run_step

NETNS_DIR = Path("/run/netns")
GUEST_INTERFACE = "eth0"
LINK_PREFIX_LENGTH = 30


def addresses(index: int) -> tuple[str, str]:
    """(this machine's side, the guest's side) of link `index`: 10.233.N.1 and 10.233.N.2."""
    return f"10.233.{index}.1", f"10.233.{index}.2"


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
    """Delete the netns of sandbox `name` if it exists (the veth pair goes with it)."""
    if netns_path(name).exists():
        run_step("delete the network namespace", ["ip", "netns", "del", netns_name(name)])
