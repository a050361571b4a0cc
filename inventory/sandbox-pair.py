"""Two sandboxes as two Sparks: one engine tensor-parallel across both, its ranks on the pair's cable.

SPARKFORM_SANDBOX_PAIR names the two sandboxes, head first (default "pair-a,pair-b"); each is a
sandbox host as in inventory/sandbox.py (sparkform.sandbox.hostdata), and they are joined by
`sparkform sandbox --name pair-a link pair-b` (interface cx7, MTU 9000, 10.234.K.0/30). The one
engine, `pair`, spans both (docs/two-sparks.md): rank 0 on the head serves the tiny Qwen3.

Bring them up with:
    sparkform sandbox --name pair-a up && sparkform sandbox --name pair-b up
    sparkform sandbox --name pair-a link pair-b
"""

import os
from pathlib import Path
from typing import NoReturn

from sparkform.inventory import InventoryError, Problem, exit_invalid, hosts
from sparkform.sandbox import network, registry
from sparkform.sandbox.hostdata import CPU_ENGINE, host_data, host_name, up_box
from sparkform.sandbox.system import SandboxError

PAIR_VARIABLE = "SPARKFORM_SANDBOX_PAIR"
PAIR = os.environ.get(PAIR_VARIABLE, "pair-a,pair-b")
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
# The fake hub's commit of sparkform-test/tiny-qwen3 (its id comes from the content, the same in
# every stage): both ranks load this commit. tests/unit/test_fakehub.py checks it.
TINY_QWEN3_COMMIT = "412d6195b3e3481b4e92c17262c153ee5a2788f0"
# What the head's node_address is while the pair is not up (no connection, no cable): index 0,
# which no sandbox holds, so the inventory plans and validates as it will once linked.
NOT_LINKED = network.cable_addresses(0)[0]


def _problem(host: str, field: str, value: object, message: str, fix: str) -> NoReturn:
    """Exit 2 with this one problem, before any connection."""
    exit_invalid(InventoryError([Problem(host, field, value, message, fix)]), __file__)


_names = PAIR.split(",")
if len(_names) != 2 or _names[0] == _names[1] or not all(registry.NAME_PATTERN.fullmatch(name) for name in _names):
    _problem(
        "the pair",
        PAIR_VARIABLE,
        PAIR,
        "is not two sandbox names (a-z, 0-9, '-'), head first, a comma between them",
        f'e.g. {PAIR_VARIABLE}="pair-a,pair-b"',
    )
_head, _worker = _names
_boxes = {name: up_box(name) for name in _names}
_nodes = [host_name(name, box) for name, box in _boxes.items()]

_head_address = NOT_LINKED
_head_box = _boxes[_head]
if _head_box is not None and _boxes[_worker] is not None:
    try:
        _cable = network.read_cable(_head_box.runtime_dir)
    except SandboxError as err:
        _problem(_head, "cable", None, str(err), f"`sparkform sandbox --name {_head} down`, then up and link again")
    if _cable is None or _cable.peer != _worker:
        _problem(
            _head,
            "cable",
            _worker,
            f"sandbox {_head} is not linked to {_worker}" + (f" (it is to {_cable.peer})" if _cable else ""),
            f"`sparkform sandbox --name {_head} link {_worker}`",
        )
    _head_address = _cable.address

_pair_engine = {
    **CPU_ENGINE,
    "name": "pair",
    "port": 8013,
    "nodes": _nodes,
    "checkpoint": {"repo": "sparkform-test/tiny-qwen3", "revision": TINY_QWEN3_COMMIT},
    "model_config_path": str(MODEL_CONFIGS / "tiny-qwen3.json"),
}

sandbox_pair = hosts(
    {
        node: {
            **host_data(_boxes[name]),
            "node_interface": network.CABLE_INTERFACE,
            # The worker's address is the cable's one address on its side, read at deploy.
            **({"node_address": _head_address} if name == _head else {}),
            "engines": [_pair_engine],
        }
        for name, node in zip(_names, _nodes, strict=True)
    },
    __file__,
)
