"""A deploy against this machine (@local) in --dry mode, as test_deploy_dry.py and
test_packaging.py run it: an inventory whose folders lie in a test's tmp_path, with a fast
engine pinned to a commit and a slow one on the branch `main` of the fake hub (the `hub`
fixture, conftest.py)."""

from __future__ import annotations

from pathlib import Path

from sparkform.sandbox.fakehub import FakeHub

FAST_COMMIT = "f" * 40  # a commit id needs no hub


def publish(hub: FakeHub, tmp_path: Path, text: str) -> str:
    """Publish org/slow with a config.json holding `text`; its commit id."""
    files = tmp_path / f"files-{text}"
    files.mkdir()
    (files / "config.json").write_text(f'{{"comment": "{text}"}}')
    return hub.add_repo("org/slow", files)


def local_inventory(tmp_path: Path, extra: str = "", endpoint: str = "http://127.0.0.1:9") -> Path:
    inventory = tmp_path / "local.py"
    inventory.write_text(f"""
from sparkform.inventory import hosts
local = hosts({{"@local": {{
    "lib_dir": "{tmp_path}/lib", "config_dir": "{tmp_path}/etc", "state_dir": "{tmp_path}/state",
    "venv_root": "{tmp_path}/venvs", "models_dir": "{tmp_path}/models", "cache_root": "{tmp_path}/cache",
    "hf_endpoint": "{endpoint}",
    "engines": [
        {{"name": "fast", "port": 18012, "checkpoint": {{"repo": "org/fast", "revision": "{FAST_COMMIT}"}},
          "gpu_memory_utilization": 0.25{extra}}},
        {{"name": "slow", "port": 18011, "checkpoint": {{"repo": "org/slow", "revision": "main"}},
          "gpu_memory_utilization": 0.45, "after": ["fast"]}},
    ],
}}}}, __file__)
""")
    return inventory
