"""The guard's watch over the ranks of an engine across hosts: a rank this host runs for a head on
another host, and which ranks a head here holds."""

import re
import subprocess
import threading
import time

from sparkform.host import GuardEngine, GuardSettings
from sparkform.host.alerts import alert
from sparkform.host.systemd import active_state, systemctl


def main_process(unit):
    """The command line of the unit's main process ("" when none runs)."""
    pid = systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as handle:
            return handle.read(65536).replace(b"\0", b" ").decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def established(*match):
    """`ss -Htn`'s lines of this host's established TCP connections that `match` (ss's filter
    words); empty when ss fails."""
    found = subprocess.run(
        ["ss", "-Htn", "state", "established", *match], capture_output=True, text=True, timeout=30, check=False
    )
    return found.stdout if found.returncode == 0 else ""


def joined(head):
    """Whether this host holds an established connection to a rank's head's master port (`head`:
    its [address, port]): the store connection a rank keeps for as long as its head lives."""
    address, port = head
    return bool(established("dst", address, "dport", "=", f":{int(port)}").strip())


# An endpoint in `ss -Htn`'s columns: an IPv4 address or a bracketed IPv6 one, then the port.
ENDPOINT = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:.]+\]):\d{1,5}")
# An IPv4 address as a dual-stack socket shows it. vLLM's store listens on one, so the head's own
# connection reads [::ffff:ADDRESS]: read as IPv4, it is known as the head's own, not a joined rank.
MAPPED = re.compile(r"\[::ffff:(\d{1,3}(?:\.\d{1,3}){3})\]", re.IGNORECASE)


def endpoint_address(column):
    """The address of an `ss` endpoint column, an IPv4-mapped IPv6 one as IPv4; None for another shape."""
    match = ENDPOINT.fullmatch(column)
    if not match:
        return None
    mapped = MAPPED.fullmatch(match[1])
    return mapped[1] if mapped else match[1]


def joined_peers(text, own_address):
    """The addresses of the established connections' peers in `ss -Htn`'s lines (Recv-Q, Send-Q,
    local, peer), less the head's own processes (the head's own processes join its store too): a
    peer at the head's address, at the line's own local address, or on loopback. A line of another
    shape is left out."""
    peers = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 4:
            continue
        local, peer = endpoint_address(fields[2]), endpoint_address(fields[3])
        if peer and peer not in (own_address, local, "[::1]") and not peer.startswith("127."):
            peers.add(peer)
    return peers


def waits_for_ranks(engine: GuardEngine):
    """Whether a head here still waits for ranks on other hosts to join its master port (vLLM's
    head sits silent and idle until every rank joined: no progress a start could be judged by)."""
    ranks = engine.get("ranks")
    if not ranks:
        return False
    joined_now = joined_peers(established("sport", "=", f":{int(ranks['port'])}"), ranks["address"])
    return len(joined_now) < ranks["count"]


class RankWatch(threading.Thread):
    """A rank this host runs headless for a head elsewhere. vLLM never ends such a rank when its head
    goes (its store connection sits closed, and a new head waits for ranks forever), so a rank whose
    connection to the head's master port closed is restarted: it waits for the head and joins it
    again. A rank that joined resets its unit's start count, as a start that served does."""

    def __init__(self, config: GuardSettings, rank: GuardEngine):
        super().__init__(daemon=True, name=f"rank watch {rank['name']}")
        self.config, self.rank = config, rank

    def run(self):
        unit, running_since, lost, counted_join = self.rank["unit"], None, 0, False
        while True:
            time.sleep(self.config["watchdog_interval_s"])
            # Still in the launch script (waiting for the head), starting or stopped: nothing to judge.
            if active_state(unit) != "active" or self.config["vllm_cli"] not in main_process(unit):
                running_since, lost, counted_join = None, 0, False
                continue
            running_since = running_since or time.monotonic()
            if time.monotonic() - running_since < self.config["rank_join_s"]:
                continue
            if joined(self.rank["head"]):
                if not counted_join:
                    systemctl("reset-failed", unit)
                    counted_join = True
                lost = 0
                continue
            lost += 1
            if lost < 2:
                continue
            systemctl("restart", unit)
            address, port = self.rank["head"]
            alert(
                self.config,
                "head-lost",
                self.rank["name"],
                f"{unit} (a rank of {self.rank['name']} for its head at {address}:{port}) lost its connection to the "
                "head's master port: restarted, to wait for the head and join it again",
            )
            running_since, lost, counted_join = None, 0, False
