"""The engines target reached again once every enabled engine serves, after a heal nobody deployed.

The target is Requisite= (not Requires=) of the engines: an engine's restart takes the target down
with it, but the target's start never starts an engine. With Requires=, each restart of one engine
queued a start of the other; a start job queued while its unit waits out RestartSec= is run and
counted against its start limit before it is dropped, so each double crash counted 2 starts
against the other engine's StartLimitBurst for its one restart: under the default 3, the second
double crash left it start-limit-hit at its first restart. Reaching the target again is then the
guard's job: the `served` hook of the engine that serves last starts it, and a watch every
watchdog interval catches any start a hook missed (the hook may fail; it never fails the
engine's start)."""

import time

from sparkform.host import GuardEngine, GuardSettings
from sparkform.host.alerts import journal
from sparkform.host.systemd import active_state, job_types, systemctl


def target_down(config: GuardSettings):
    """Whether the host has the target, enabled, and it is not active."""
    target = config.get("engines_target")
    return (
        bool(target) and systemctl("is-enabled", "--quiet", target).returncode == 0 and active_state(target) != "active"
    )


def reach_target_after(config: GuardSettings, engine: GuardEngine):
    """Right after `engine` served (its ExecStartPost): the target started without waiting, when it
    is enabled and down and every other engine is up or starting (its start job then waits for
    theirs, After=, and fails harmlessly if one of them fails: the watch below tries again)."""
    if not target_down(config):
        return
    others = [e["unit"] for e in config["engines"] if e["unit"] != engine["unit"]]
    if all(active_state(unit) in ("active", "activating") for unit in others):
        systemctl("start", "--no-block", config["engines_target"])


def serving_without_target(config: GuardSettings):
    """Whether the target is enabled and down, no job is queued for it, and every enabled engine is
    active (started and served) with none queued either: a heal, not a deploy under way."""
    if not target_down(config) or job_types(config["engines_target"]):
        return False
    return all(active_state(e["unit"]) == "active" and not job_types(e["unit"]) for e in config["engines"])


def target_watch(config: GuardSettings, beats):
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
