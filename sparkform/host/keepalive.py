"""The guard's own watchdog: systemd restarts the guard when it stops telling systemd it is alive
(WatchdogSec= of sparkform-guard.service). The daemon's main loop tells it only while every one of
its threads has beaten within the bound that thread set, so a stopped (SIGSTOP), dead or stuck
guard is restarted, not left `active` watching nothing."""

import os
import socket
import threading
import time


def notify(message):
    """sd_notify(3): one datagram to $NOTIFY_SOCKET (none outside a Type=notify unit: nothing)."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode(), address)
    except OSError:
        pass  # systemd restarts a guard whose keep-alives never arrive


class Beats:
    """Each thread's latest promise: "I beat again within N s"."""

    def __init__(self):
        self.lock, self.due = threading.Lock(), {}

    def beat(self, name, within_s):
        with self.lock:
            self.due[name] = time.monotonic() + within_s

    def late(self):
        """The threads past their promise."""
        now = time.monotonic()
        with self.lock:
            return sorted(name for name, due in self.due.items() if due < now)
