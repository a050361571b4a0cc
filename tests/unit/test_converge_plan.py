"""The converge plan decided on snapshots, without pyinfra: what restarts, what counts as a cold
start, which boot-chain holes a run repairs, which units are leftovers, and in which order."""

from __future__ import annotations

import dataclasses

from samples import CPU_PAIR, DRIVER_580, converged

from sparkform.domain import layout
from sparkform.readers.kept import KeptSettings, Rollback
from sparkform.readers.snapshot import CheckpointFolder, RemoteFile, Snapshot
from sparkform.rules.inventory import load_host
from sparkform.writers import converge
from sparkform.writers.converge import plan

DRIVER_590 = ["kernel=6.1.0", "driver=590.10.01", "gpu_arch=12.1"]


def config(**changes):
    data = {**CPU_PAIR, **changes}
    return load_host("box", data).config


def engine_data(name: str, **changes) -> list[dict]:
    return [{**e, **changes} if e["name"] == name else e for e in CPU_PAIR["engines"]]


def test_a_fresh_host_starts_every_engine_cold_in_after_order():
    result = plan(config(), Snapshot(live_versions=DRIVER_580))
    assert [step.engine.name for step in result.steps] == ["fast", "slow"]
    assert all(step.starts and step.cold and not step.stale for step in result.steps)
    assert result.started == {"fast": True, "slow": True}
    assert result.daemon_reload
    assert result.holes == [] and result.leftovers == [] and result.disabled == []
    assert result.drift_lines == [] and result.drift_alert is None  # no record: nothing to compare with
    assert result.stale_steps == [] and result.engines_target
    # Shared scripts go before each engine's unit and settings; every rendered file is in one of them.
    assert {f.engine for f in result.engine_files} == {"fast", "slow"}
    assert {f.path for f in result.shared_files} | {f.path for f in result.engine_files} == {
        f.path for f in result.rendered
    }
    assert not {f.path for f in result.shared_files} & {f.path for f in result.engine_files}


def test_a_converged_host_plans_no_start_no_reload_and_the_same_record():
    cfg = config()
    snapshot = converged(cfg)
    result = plan(cfg, snapshot)
    assert [(s.starts, s.restart, s.stale) for s in result.steps] == [(False, False, False)] * 2
    assert result.started == {}
    assert not result.daemon_reload
    assert result.record == snapshot.record
    assert result.holes == [] and result.leftovers == [] and result.drift_lines == []


def test_an_edited_engine_restarts_alone_and_warm():
    snapshot = converged(config())
    result = plan(config(engines=engine_data("slow", extra_args=["--max-num-seqs", "4"])), snapshot)
    steps = {s.engine.name: s for s in result.steps}
    assert (steps["slow"].restart, steps["slow"].starts, steps["slow"].cold) == (True, True, False)
    assert (steps["fast"].restart, steps["fast"].starts) == (False, False)
    assert result.started == {"slow": False}
    assert not result.daemon_reload  # only its .args file changed, no unit


def test_an_engine_that_is_down_starts_without_a_restart_order():
    cfg = config()
    snapshot = converged(cfg)
    unit = layout.engine_unit("fast")
    snapshot.engines[unit] = dataclasses.replace(snapshot.engines[unit], active_state="failed", main_pid=0)
    steps = {s.engine.name: s for s in plan(cfg, snapshot).steps}
    assert (steps["fast"].restart, steps["fast"].starts, steps["fast"].cold) == (False, True, False)
    assert not steps["slow"].starts


def test_a_new_driver_makes_both_engines_stale_cold_and_says_so():
    cfg = config()
    result = plan(cfg, dataclasses.replace(converged(cfg), live_versions=DRIVER_590))
    assert [(s.engine.name, s.stale, s.restart, s.cold) for s in result.steps] == [
        ("fast", True, True, True),
        ("slow", True, True, True),
    ]
    assert all(key.startswith("driver590.10.01") for key in result.cache_keys.values())
    assert any(line.startswith("driver 580.95.05 -> 590.10.01") for line in result.drift_lines)
    assert result.drift_alert == "; ".join(result.drift_lines)  # the guard alerts before any start
    assert [step.engine.name for step in result.stale_steps] == ["fast", "slow"]
    assert result.record.versions.driver == "590.10.01"


def test_a_kernel_update_alone_restarts_nothing():
    cfg = config()
    result = plan(cfg, dataclasses.replace(converged(cfg), live_versions=["kernel=6.12.0", *DRIVER_580[1:]]))
    assert result.started == {}
    assert result.drift_lines == ["kernel 6.1.0 -> 6.12.0: JIT caches unaffected"]


def test_caches_a_failed_run_moved_aside_stay_stale():
    cfg = config()
    aside = f"{cfg.engine_cache_dir(cfg.engines[0])}.stale-oldkey"  # slow's
    result = plan(cfg, dataclasses.replace(converged(cfg), caches_aside=[aside]))
    assert {s.engine.name: s.stale for s in result.steps} == {"fast": False, "slow": True}


def test_a_unit_of_an_engine_gone_from_inventory_is_a_leftover_to_remove():
    cfg = config()
    snapshot = converged(cfg)
    gone = layout.unit_path(layout.engine_unit("old-model"))
    result = plan(cfg, dataclasses.replace(snapshot, rendered_units=snapshot.rendered_units | {gone}))
    assert result.leftovers == [converge.LeftoverEngine("old-model", gone, cfg.paths.engine_settings("old-model"))]
    assert result.daemon_reload
    assert result.started == {}


def test_disabled_engine_stops_and_its_waiter_loses_the_edge_reloaded_not_restarted():
    """Its waiter's unit changes in its After= line alone: systemd takes the new order on the
    reload, and the waiter keeps serving its clients."""
    snapshot = converged(config())
    result = plan(config(engines=engine_data("fast", enabled=False)), snapshot)
    assert [e.name for e in result.disabled] == ["fast"]
    assert [s.engine.name for s in result.steps] == ["slow"]
    slow_unit = layout.unit_path(layout.engine_unit("slow"))
    assert slow_unit in {f.path for f in result.engine_files if f.path in snapshot.paths} and result.daemon_reload
    assert (result.steps[0].restart, result.steps[0].starts) == (False, False)


def test_a_unit_changed_beyond_its_order_restarts_its_engine():
    """The same edge lost, and the unit's RestartSec= changed too: a restart, as for any setting."""
    snapshot = converged(config())
    result = plan(config(engines=engine_data("fast", enabled=False), restart_s=7), snapshot)
    assert result.steps[0].restart and result.steps[0].starts


def test_a_host_without_order_blind_digests_restarts_on_any_unit_change():
    """A host whose units were not read that way (or a unit of another shape) is never taken for
    a change of order alone."""
    snapshot = dataclasses.replace(converged(config()), order_blind={})
    result = plan(config(engines=engine_data("fast", enabled=False)), snapshot)
    assert result.steps[0].restart


def test_a_hole_from_an_engine_disabled_by_hand_is_repaired_by_starting_it():
    cfg = config()
    snapshot = converged(cfg)
    snapshot.unit_files[layout.engine_unit("fast")] = "disabled"
    result = plan(cfg, snapshot)
    assert result.holes == [
        converge.BootChainHole(layout.engine_unit("slow"), layout.engine_unit("fast"), "disabled", repaired=True)
    ]


def test_a_hole_from_a_hand_made_drop_in_is_named_and_not_repaired():
    cfg = config()
    snapshot = converged(cfg)
    slow = layout.engine_unit("slow")
    hand_made = layout.engine_unit("elsewhere")  # After= from a drop-in: sparkform's file is unchanged
    snapshot.engines[slow] = dataclasses.replace(
        snapshot.engines[slow], after=(*snapshot.engines[slow].after, hand_made)
    )
    result = plan(cfg, snapshot)
    assert result.holes == [converge.BootChainHole(slow, hand_made, "missing", repaired=False)]
    assert result.started == {}


def test_a_new_api_key_changes_the_fronts_settings_and_restarts_no_engine(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_text("k" * 32)
    second.write_text("z" * 32)
    first.chmod(0o600)
    second.chmod(0o600)
    cfg = config(api_key_file=str(first))
    snapshot = converged(cfg)
    rotated = plan(config(api_key_file=str(second)), snapshot)
    assert rotated.front_wanted != plan(cfg, snapshot).front_wanted
    assert rotated.front_wanted.split()[0] == plan(cfg, snapshot).front_wanted.split()[0]  # drop-in unchanged
    assert rotated.guard_wanted == plan(cfg, snapshot).guard_wanted
    assert rotated.started == {}


def test_the_snapshot_request_reads_every_file_the_plan_compares():
    cfg = config()
    request = converge.snapshot_request(cfg)
    result = plan(cfg, Snapshot())
    assert {f.path for f in result.rendered} | set(result.unwanted) <= set(request["paths"])
    assert {layout.engine_unit("fast"), layout.engine_unit("slow"), layout.ENGINES_TARGET} <= set(request["units"])
    assert request["record_path"] == cfg.paths.host_record
    assert [service.stamp for service in result.services] == request["markers"][-3:]
    assert [layout.FRONT_UNIT, layout.GUARD_UNIT, layout.SCRUB_TIMER] == request["units"][-3:]


def test_the_services_follow_the_engines_as_one_table_each_with_its_stamp():
    cfg = config()
    result = plan(cfg, converged(cfg))
    assert [(s.service, s.name) for s in result.services] == [
        ("nginx", "Front (nginx) serving"),
        ("guard", "Guard (watchdog, memory guard, alerts) running"),
        ("scrub", "Checkpoint scrub (weekly)"),
    ]
    assert [s.wanted for s in result.services] == [result.front_wanted, result.guard_wanted, result.scrub_wanted]
    assert [s.stamp for s in result.services] == [cfg.paths.stamp(s.service) for s in result.services]
    assert all(s.current is None and s.applied is None for s in result.services)  # none of them runs yet
    # The front takes over each served engine's port, in start order, and the combined one.
    assert result.services[0].options == {"address": "127.0.0.1", "ports": [8012, 8011, cfg.front_port]}
    assert result.services[2].options == {"enabled": True, "unit": layout.SCRUB_TIMER}


def test_the_scrub_off_and_node_exporter_on_are_decided_in_the_table():
    cfg = config(scrub={"enabled": False}, monitoring={"enabled": True})
    snapshot = dataclasses.replace(converged(cfg), installed_packages={layout.NODE_EXPORTER_PACKAGE})
    *_, scrub, node_exporter = plan(cfg, snapshot).services
    assert (scrub.name, scrub.options["enabled"]) == ("Checkpoint scrub off", False)
    assert (node_exporter.service, node_exporter.options["installed"]) == ("node-exporter", True)
    assert node_exporter.wanted == plan(cfg, snapshot).node_exporter_wanted
    assert node_exporter.stamp in converge.snapshot_request(cfg)["markers"]


def test_a_host_with_no_engine_enabled_leaves_target_and_front_ports_alone():
    cfg = config(engines=[{**e, "enabled": False} for e in CPU_PAIR["engines"]])
    result = plan(cfg, converged(config()))
    assert not result.engines_target and result.steps == []
    assert result.services[0].options["ports"] == []  # no combined port without an engine behind it


def test_an_engine_whose_checkpoint_is_fetched_again_restarts_alone_warm():
    """A file that left its manifest (or a marker gone) is fetched again: the running engine
    still holds the old bytes, so it restarts on the fetched ones."""
    cfg = config()
    snapshot = converged(cfg)
    (fast,) = [e for e in cfg.engines if e.name == "fast"]
    folder = cfg.checkpoint_dir(fast)
    for damaged in (
        CheckpointFolder(cfg.commit(fast), ["model.safetensors"], 950.0),
        CheckpointFolder(None, [], 950.0),
    ):
        snapshot.checkpoints[folder] = damaged
        steps = {s.engine.name: s for s in plan(cfg, snapshot).steps}
        assert (steps["fast"].restart, steps["fast"].starts, steps["fast"].cold) == (True, True, False)
        assert (steps["slow"].restart, steps["slow"].starts) == (False, False)


def kept_as_converged(cfg, snapshot: Snapshot) -> Snapshot:
    """`snapshot` with each enabled engine's settings of `cfg` kept, as the deploy keeps them once
    the engine served them."""
    fresh = plan(cfg, snapshot)
    kept = {
        step.engine.name: KeptSettings(step.engine.name, 1000, cfg.venv, cfg.checkpoint_dir(step.engine), step.settings)
        for step in fresh.steps
    }
    return dataclasses.replace(snapshot, kept=kept)


def test_a_changed_engine_goes_back_to_kept_settings_if_its_start_fails():
    cfg = config()
    snapshot = kept_as_converged(cfg, converged(cfg))
    steps = {s.engine.name: s for s in plan(cfg, snapshot).steps}
    assert not steps["slow"].rolls_back and not steps["slow"].starts  # nothing changed, nothing starts
    edited = config(engines=engine_data("slow", extra_args=["--max-num-seqs", "4"]))
    steps = {s.engine.name: s for s in plan(edited, snapshot).steps}
    assert steps["slow"].rolls_back and steps["slow"].settings != snapshot.kept["slow"].digest
    assert not steps["fast"].rolls_back  # the neighbour does not start
    # Down on the very settings it last served with: a failed start has nothing to go back to.
    unit = layout.engine_unit("fast")
    snapshot.engines[unit] = dataclasses.replace(snapshot.engines[unit], active_state="failed", main_pid=0)
    steps = {s.engine.name: s for s in plan(cfg, snapshot).steps}
    assert steps["fast"].starts and not steps["fast"].rolls_back


def test_an_engine_without_kept_settings_has_nothing_to_go_back_to():
    cfg = config()
    edited = config(engines=engine_data("slow", extra_args=["--max-num-seqs", "4"]))
    steps = {s.engine.name: s for s in plan(edited, converged(cfg)).steps}
    assert steps["slow"].starts and not steps["slow"].rolls_back


def test_dry_run_names_engine_on_previous_settings_until_inventory_changes():
    cfg = config()
    snapshot = kept_as_converged(cfg, converged(cfg))
    failing = config(engines=engine_data("slow", extra_args=["--no-such-flag"]))
    failed = {s.engine.name: s.settings for s in plan(failing, snapshot).steps}["slow"]
    reason = "error: unrecognized arguments: --no-such-flag"
    snapshot = dataclasses.replace(snapshot, rollbacks={"slow": Rollback("slow", 1764575600, "deploy", reason, failed)})
    assert plan(failing, snapshot).rollback_lines == [
        f"slow runs its previous settings since 2025-12-01 07:53 UTC: {reason}"
    ]
    # The owner changed it again (or back): the rollback is history, the run says nothing of it.
    retried = config(engines=engine_data("slow", extra_args=["--max-num-seqs", "4"]))
    assert plan(retried, snapshot).rollback_lines == []
    assert plan(cfg, snapshot).rollback_lines == []


def test_a_link_at_a_managed_path_is_untrusted_unless_the_path_is_removed():
    models, site = "/var/lib/sparkform/models", "/etc/nginx/sites-enabled/default"
    found = Snapshot(
        paths={
            models: RemoteFile(None, "777", "vllm", "vllm", link=True),
            "/etc/sparkform": RemoteFile(None, "755", "root", "root"),
            site: RemoteFile(None, "777", "root", "root", link=True),  # Debian's, removed as it is
        }
    )
    (finding,) = found.planted_links([site])
    assert finding.startswith(f"{models} is a symbolic link")
