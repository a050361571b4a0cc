"""The engines target reached again once every enabled engine serves, after a heal nobody deployed.

The target is Requisite= (not Requires=) of the engines: an engine's restart takes the target down
with it, but the target's start never starts an engine. With Requires=, each restart of one engine
queued a start of the other; a start job queued while its unit waits out RestartSec= is run and
counted against its start limit before it is dropped, so each double crash spent one start of the
other engine's StartLimitBurst on nothing (start-limit-hit in CI's second round: an engine dark
for good). Reaching the target again is then this watch's job."""

import time

from sparkform.host.alerts import journal
from sparkform.host.systemd import active_state, job_types, systemctl


def serving_without_target(config):
    """Whether the target is enabled and down, no job is queued for it, and every enabled engine is
    active (started and served) with none queued either: a heal, not a deploy under way."""
    target = config.get("engines_target")
    if not target or systemctl("is-enabled", "--quiet", target).returncode != 0:
        return False
    if active_state(target) == "active" or job_types(target):
        return False
    return all(active_state(e["unit"]) == "active" and not job_types(e["unit"]) for e in config["engines"])


def target_watch(config, beats):
    """The daemon's thread: every watchdog interval, the engines target started again (without
    waiting: its start only checks that the engines are active) once every engine serves."""
    interval = config["watchdog_interval_s"]
    while True:
        beats.beat("target", interval + 300)  # each systemctl call is bounded at 120 s
        time.sleep(interval)
        if serving_without_target(config):
            systemctl("start", "--no-block", config["engines_target"])
            journal(
                config,
                f"sparkform-guard: every engine serves again: {config['engines_target']} started again",
                5,
                sparkform_event="target-reached",
            )
