"""The real deploy on the sandbox: converge from scratch, verify, stay idempotent, show diffs
without changing anything, restart only what changed, and come back in order after a reboot.

One sandbox for the module; the tests run in file order and each leaves the host converged.
Everything is read from systemd, the journal and the endpoints, not from the toolkit's output.
"""

from __future__ import annotations

import re
import shutil
import time

from deploy_helpers import (SANDBOX_INVENTORY, both_serving_after_boot, changed_operations, checkpoint_dir,
                            edited_inventory, journal_times, main_pids, pyinfra, ssh, verify)

from sparkform.sandbox import host
from sparkform.sandbox.fakehub import FakeHub



def test_converge_from_scratch_then_verify(box):
    started = time.monotonic()
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"\nconverge from scratch: {time.monotonic() - started:.0f} s")
    result = verify()
    assert result.returncode == 0, result.stdout[-4000:]


def test_second_run_changes_nothing(box):
    before = main_pids(box)
    assert changed_operations(SANDBOX_INVENTORY) == []
    result = pyinfra(SANDBOX_INVENTORY, "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    assert main_pids(box) == before


def test_dry_diff_shows_only_the_edited_file_and_changes_nothing(box, tmp_path):
    inventory = edited_inventory(tmp_path, {"q38": {"max_num_seqs": 2}})
    args_file = "/etc/sparkform/engines/q38.args"
    before = ssh(box, f"sha256sum {args_file} /etc/sparkform/engines/* /etc/systemd/system/vllm-*").stdout
    result = pyinfra(inventory, "--dry", "--diff")
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    modified = re.findall(r"Will (?:modify|create) (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", out))
    assert modified == [args_file]
    diff = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert re.search(r"^\s*-\s*4$", diff, re.M) and re.search(r"^\s*\+\s*2$", diff, re.M), diff[-3000:]
    # The restart takes the engines target with it, and the new start goes into the host record.
    assert changed_operations(inventory) == [f"File {args_file}", "Engine q38 serving",
                                             "sparkform-engines.target reached", "Host record"]
    assert ssh(box, f"sha256sum {args_file} /etc/sparkform/engines/* /etc/systemd/system/vllm-*").stdout == before


def test_edit_restarts_only_that_engine(box, tmp_path):
    before = main_pids(box)
    result = pyinfra(edited_inventory(tmp_path, {"q38": {"max_num_seqs": 2}}), "-y")
    assert result.returncode == 0, result.stderr[-4000:]
    after = main_pids(box)
    assert after["vllm-nemotron.service"] == before["vllm-nemotron.service"]
    assert after["vllm-q38.service"] not in (0, before["vllm-q38.service"])
    cmdline = ssh(box, f"tr '\\0' ' ' < /proc/{after['vllm-q38.service']}/cmdline").stdout
    assert "--max-num-seqs 2 " in cmdline
    # Back to the inventory as checked in: again only q38 moves.
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert main_pids(box)["vllm-nemotron.service"] == before["vllm-nemotron.service"]


def test_broken_inventory_fails_before_connecting(box, tmp_path):
    result = pyinfra(edited_inventory(tmp_path, {"q38": {"after": ["nemotorn"]}}), "-y")
    assert result.returncode == 2
    assert "engine q38: after = 'nemotorn': no engine of that name" in result.stderr
    assert "Connecting" not in result.stdout + result.stderr


def test_reboot_brings_both_back_second_after_first_is_ready(box):
    host.reboot(box.name)
    both_serving_after_boot(box)
    (nemotron_ready,) = journal_times(box, r"sparkform-wait-ready: port 8012 serves")
    (q38_start,) = journal_times(box, r"sparkform-launch: starting q38")
    assert q38_start > nemotron_ready, "q38 started before nemotron was ready"
    print(f"\nafter the reboot q38 started {q38_start - nemotron_ready:.1f} s after nemotron was ready")
    result = verify()
    assert result.returncode == 0, result.stdout[-4000:]
    # Same versions after the reboot: the deploy only records the boot's starts.
    assert changed_operations(SANDBOX_INVENTORY) == ["Host record"]
    before = main_pids(box)
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert main_pids(box) == before


SHARD = "model-00001-of-00002.safetensors"  # of nemotron's checkpoint


def test_checkpoint_drift_is_caught_deep_verify_names_it_and_a_truncated_shard_is_fetched_again(box):
    assert verify("--deep").returncode == 0
    shard = f"{checkpoint_dir(box, 'nemotron')}/{SHARD}"
    # A flipped byte, size and mtime kept: the no-op run trusts the manifest; --deep re-hashes.
    ssh(box, "python3 -c \"import os,sys; p=sys.argv[1]; st=os.stat(p); f=open(p,'r+b'); f.seek(st.st_size//2); "
             "b=f.read(1); f.seek(st.st_size//2); f.write(bytes([b[0]^255])); f.close(); "
             f"os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))\" {shard}")
    assert changed_operations(SANDBOX_INVENTORY) == []
    result = verify("--deep")
    assert result.returncode != 0 and "model-00001-of-00002.safetensors" in result.stdout
    # A truncated shard: its size no longer matches the manifest, so the deploy fetches it again.
    ssh(box, f"truncate -s 1000 {shard}")
    assert [name.split(":")[0] for name in changed_operations(SANDBOX_INVENTORY)] == ["Checkpoint of nemotron"]
    before = main_pids(box)
    assert pyinfra(SANDBOX_INVENTORY, "-y").returncode == 0
    assert verify("--deep").returncode == 0  # the flipped byte went with the re-fetch
    assert main_pids(box) == before  # same revision, same files: nothing to restart


def test_moved_branch_changes_nothing_and_a_new_pin_replaces_the_old_revision_only_once_it_serves(box, tmp_path):
    hub = FakeHub(box.runtime_dir / "hub")
    repo = "sparkform-test/tiny-llama"  # q38's
    first = hub.resolve(repo, "main")
    first_dir = checkpoint_dir(box, "q38")
    assert first_dir.endswith(f"@{first}")
    files = tmp_path / "next-revision"
    shutil.copytree(hub.repo_dir(repo) / first, files)
    (files / "README.md").write_text("the next revision\n")
    moved = hub.add_repo(repo, files)  # `main` moves on the hub
    assert moved != first
    # The host recorded what main named: the moved branch changes nothing.
    assert changed_operations(SANDBOX_INVENTORY) == []

    before = main_pids(box)
    new_pin = edited_inventory(tmp_path, {"q38": {"checkpoint": {"repo": repo, "revision": moved}}},
                               {"keep_revisions": 0})
    # A new revision that never verifies (the hub serves a shard corrupt): the old one keeps serving.
    hub.corrupt_file(repo, "model.safetensors", revision=moved)
    try:
        failed = pyinfra(new_pin, "-y")
    finally:
        hub.corrupt_file(repo, "model.safetensors", revision=moved, corrupt=False)
    assert failed.returncode != 0
    assert main_pids(box) == before
    assert checkpoint_dir(box, "q38") == first_dir  # q38's settings still name the verified revision
    assert ssh(box, f"test -f {first_dir}/.sparkform-complete", check=False).returncode == 0

    result = pyinfra(new_pin, "-y")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    after = main_pids(box)
    assert after["vllm-nemotron.service"] == before["vllm-nemotron.service"]
    assert after["vllm-q38.service"] != before["vllm-q38.service"]
    assert checkpoint_dir(box, "q38").endswith(f"@{moved}")
    # keep_revisions 0: the old folder (and the pin naming it) went, after q38 served the new one.
    assert ssh(box, f"test -e {first_dir}", check=False).returncode == 1
    assert ssh(box, "grep -rl " + first + " /var/lib/sparkform/models/.pins", check=False).stdout == ""
    out = result.stdout + result.stderr
    assert out.index("Remove old checkpoint revisions") > out.index("Engine q38 serving")
    verified = verify(inventory=new_pin)
    assert verified.returncode == 0, verified.stdout[-4000:]
