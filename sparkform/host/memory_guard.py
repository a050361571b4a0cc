"""The guard's memory guard: cgroups do not see CUDA allocations on GB10, so below the critical
floor of MemAvailable the lowest-priority engine is stopped before the kernel's OOM killer picks
a victim, and started again once memory is back."""

import time

from sparkform.host import GuardSettings
from sparkform.host.alerts import alert
from sparkform.host.systemd import active_state, started_afresh, systemctl


def mem_available_gib(path="/proc/meminfo"):
    with open(path) as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise ValueError(f"no MemAvailable in {path}")


def memory_guard(config: GuardSettings, held, beats):
    """Stop the lowest-priority engine below the critical floor; start it again once memory is
    back above the warning floor + margin. `held` names the engines this guard stopped."""
    warned = False
    # A rank for a head elsewhere is not the guard's to stop: its head's host decides for the pair.
    by_priority = sorted((e for e in config["engines"] if not e.get("head")), key=lambda e: e["priority"])
    while True:
        beats.beat("memory", config["memory_settle_s"] + config["memory_poll_s"] + 60)
        available = mem_available_gib(config.get("meminfo", "/proc/meminfo"))
        if available < config["memory_critical_gib"]:
            running = [
                e
                for e in by_priority[:-1]
                if e["name"] not in held and active_state(e["unit"]) in ("active", "activating")
            ]
            if running:
                victim = running[0]
                held.add(victim["name"])
                systemctl("stop", victim["unit"])
                alert(
                    config,
                    "memory-critical",
                    victim["name"],
                    f"MemAvailable {available:.1f} GiB is below the critical floor "
                    f"({config['memory_critical_gib']} GiB): stopped {victim['unit']} (priority "
                    f"{victim['priority']}) before the kernel's OOM killer picks a victim",
                )
                time.sleep(config["memory_settle_s"])
                continue
        if available < config["memory_warn_gib"] and not warned:
            warned = True
            alert(
                config,
                "memory-low",
                "-",
                f"MemAvailable {available:.1f} GiB is below the warning floor ({config['memory_warn_gib']} GiB)",
            )
        if available >= config["memory_warn_gib"] + config["memory_margin_gib"]:
            warned = False
        for engine in reversed(by_priority):  # highest priority first, one per round
            # Back only with room for the engine itself, or starting it would stop it again.
            floor = config["memory_warn_gib"] + config["memory_margin_gib"] + engine["need_gib"]
            if engine["name"] in held and available >= floor:
                # A start asked for meanwhile was refused for memory and may have spent the
                # start limit: the guard that held the engine brings it back now.
                started_afresh(engine["unit"])
                held.discard(engine["name"])
                alert(
                    config,
                    "memory-recovered",
                    engine["name"],
                    f"MemAvailable {available:.1f} GiB is back above {floor:.1f} GiB (the warning floor, "
                    f"the margin and what {engine['name']} needs): started {engine['unit']} again",
                )
                time.sleep(config["memory_settle_s"])
                break
        time.sleep(config["memory_poll_s"])
