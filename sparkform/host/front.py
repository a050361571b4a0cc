"""The guard's watch over the front: clients are served only while nginx passes a keyed request
to a serving engine. An engine that serves on its own port but not through the front (nginx in
a restart loop, a broken configuration) is dark for every client, so after watchdog_failures
rounds in a row of that the guard alerts once, and once more when the front passes again."""

import ssl
import time
import urllib.request

from sparkform.host import GuardedFront, GuardSettings
from sparkform.host.alerts import alert, journal
from sparkform.host.front_keys import front_key


def pinned_context(certificate):
    """A TLS context that trusts the front's own certificate and nothing else (not even the
    system's authorities), whatever name it holds: the guard reaches it on a local address."""
    context = ssl.create_default_context(cafile=certificate)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.check_hostname = False
    return context


def passes(front: GuardedFront, key, deadline_s, certificate=None):
    """Whether the front's port answered /v1/models with 200, with the key (over TLS when
    `certificate`, the front's, is given: a port that shows another sends it no key)."""
    host = f"[{front['address']}]" if ":" in front["address"] else front["address"]
    scheme = "https" if certificate else "http"
    request = urllib.request.Request(f"{scheme}://{host}:{front['port']}/v1/models")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        context = pinned_context(certificate) if certificate else None
        with urllib.request.urlopen(request, timeout=deadline_s, context=context) as response:
            return response.status == 200
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


class KnownKey:
    """The key the guard's front probe sends: the front's key file as last read. While the file is
    gone or not of the deploy's making, nginx keeps serving the configuration it loaded (a reload
    without the file fails, leaving it as it was), so the last key read still opens it: a missing
    file is journaled once, as what it is, never taken for a dark front."""

    def __init__(self, config: GuardSettings):
        self.config, self.path, self.key, self.missing = config, config.get("front_key"), None, False

    def read(self):
        if not self.path:
            return None
        key = front_key(self.path)
        if key is None and not self.missing:
            journal(
                self.config,
                f"sparkform-guard: the front's key file {self.path} is gone or holds no client's key: nginx keeps the "
                "keys it loaded, but a reload or restart of nginx fails until the deploy writes it again "
                "(pyinfra INVENTORY deploy.py)",
                3,
            )
        elif key is not None and self.missing:
            journal(self.config, f"sparkform-guard: the front's key file {self.path} is back", 5)
        self.missing = key is None
        self.key = key or self.key
        return self.key


def front_watch(config: GuardSettings, beats, serving):
    """`serving`: the engines the watchdog saw answer in its last round (a dark engine is the
    watchdog's; the front is judged on those that serve)."""
    interval, deadline = config["watchdog_interval_s"], config["watchdog_deadline_s"]
    failures, down, known = 0, False, KnownKey(config)
    while True:
        beats.beat("front", interval + deadline * len(config["fronts"]) + 60)
        time.sleep(interval)
        checked = [f for f in config["fronts"] if f["engine"] in serving]
        key = known.read()
        failed = [f for f in checked if not passes(f, key, deadline, config.get("front_certificate"))]
        failures = failures + 1 if failed else 0
        if failures >= config["watchdog_failures"] and not down:
            down = True
            ports = ", ".join(f"{f['port']} ({f['engine']})" for f in failed)
            alert(
                config,
                "front-down",
                "-",
                f"the front ({config['front_unit']}) passes no request to engines that serve: port(s) {ports}; "
                f"clients get nothing. See: systemctl status {config['front_unit']}",
            )
        elif down and checked and not failed:
            down = False
            alert(config, "front-recovered", "-", "the front passes requests to the engines again")
