"""The guard's watch over the ranks of an engine across hosts: a rank this host runs for a head on
another host, and which ranks a head here holds."""

import re
import subprocess
import threading
import time

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


def joined(rank):
    """Whether this host holds an established connection to the rank's head's master port: the
    store connection a rank keeps for as long as its head lives."""
    address, port = rank["head"]
    return bool(established("dst", address, "dport", "=", f":{int(port)}").strip())


# A peer in `ss -Htn`'s last column: an IPv4 address or a bracketed IPv6 one, then the port.
PEER = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:.]+\]):\d{1,5}")


def joined_peers(text, own_address):
    """The addresses, other than the head's own and loopback (the head's own processes join its
    store too), of the established connections in `ss -Htn`'s lines (Recv-Q, Send-Q, local,
    peer); a line of another shape is left out."""
    peers = set()
    for line in text.splitlines():
        fields = line.split()
        match = PEER.fullmatch(fields[-1]) if len(fields) == 4 else None
        if match and match[1] not in (own_address, "[::1]") and not match[1].startswith("127."):
            peers.add(match[1])
    return peers


def waits_for_ranks(engine):
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

    def __init__(self, config, rank):
        super().__init__(daemon=True)
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
            if joined(self.rank):
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
