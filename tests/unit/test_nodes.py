"""An engine across two Sparks (engines[].nodes): the rules across hosts (sparkform/rules/nodes.py), what
each node needs by itself (validate.py), and the planner's split of a tensor-parallel engine into
per-node shares (planner.py).

The pair: spark-a serves nemotron alone and, with spark-b, `big` (a dense 32B model, 60 GiB of
weights) tensor-parallel across both. Every invalid case goes through `inventory.hosts()`, the
helper an inventory module calls when pyinfra imports it: exit 2 before any connection, each
problem on one line naming the host, the engine, the field and the fix.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkform import cli
from sparkform.commands.fields import field_table
from sparkform.domain import layout, modelconfig
from sparkform.domain.engine import Span
from sparkform.domain.locks import LOCKS
from sparkform.domain.model import Host
from sparkform.domain.schema import HostConfig
from sparkform.rules import inventory as inventory_module
from sparkform.rules import nodes, planner
from sparkform.writers import render

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
INVENTORY_FILE = str(MODEL_CONFIGS / "pair.py")  # only its folder is read: model configs resolve there
COMMIT = "3f1c" * 10
GIB = 2**30

Pair = dict[str, dict[str, Any]]
Mutator = Callable[[Pair], None]


@pytest.fixture
def pair(seed_data) -> Pair:
    nemotron = next(engine for engine in seed_data["engines"] if engine["name"] == "nemotron")
    big = {
        "name": "big",
        "port": 8013,
        "checkpoint": {"repo": "Qwen/Qwen3-32B", "revision": COMMIT},
        "gpu_memory_utilization": 0.55,
        "max_model_len": 32_768,
        "nodes": ["spark-a", "spark-b"],
        "weights_gib": 60.0,
        "model_config_path": "qwen3_32b_dense.json",
    }
    version = {"vllm_version": seed_data["vllm_version"]}
    return {
        "spark-a": {
            **version,
            "node_interface": "enp1s0f1np1",
            "node_address": "10.0.0.1",
            "nccl_ib_hca": ["rocep1s0f1", "roceP2p1s0f1"],
            "engines": [nemotron, big],
        },
        # The worker: another interface name, its address read off the interface at deploy.
        "spark-b": {**version, "node_interface": "enP2p1s0f1np1", "engines": [copy.deepcopy(big)]},
    }


def big_on(*hosts: str, **fields: Any) -> Mutator:
    """Set fields of `big` on these hosts (on both when none is named)."""

    def mutate(data: Pair) -> None:
        for name in hosts or ("spark-a", "spark-b"):
            next(engine for engine in data[name]["engines"] if engine["name"] == "big").update(copy.deepcopy(fields))

    return mutate


def on(host: str, **fields: Any) -> Mutator:
    def mutate(data: Pair) -> None:
        data[host].update(copy.deepcopy(fields))

    return mutate


def without(host: str, field: str) -> Mutator:
    def mutate(data: Pair) -> None:
        data[host].pop(field)

    return mutate


def invalid_lines(data: Pair, capsys) -> list[str]:
    """The problems `inventory.hosts` prints for `data`, having exited 2."""
    with pytest.raises(SystemExit) as caught:
        inventory_module.hosts(data, INVENTORY_FILE)
    assert caught.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"sparkform: invalid inventory {INVENTORY_FILE}:"
    return lines[1:]


def loaded(data: Pair) -> dict[str, Host]:
    inventory_module.hosts(data, INVENTORY_FILE)  # exits 2 when invalid
    return {name: inventory_module.load_host(name, host, MODEL_CONFIGS) for name, host in data.items()}


# spark-b with 50 GiB: 0.55 of it (27.5 GiB) cannot hold a rank's 30 GiB of weights and 2.5 of workspace.
SMALL_NODE = on("spark-b", memory_total_gib=50.0, memory_high_gib=40.0, memory_max_gib=45.0)

# (id, mutator, host, field, texts the line holds besides the fix)
INVALID = [
    ("python", on("spark-b", python="python3.11"), "spark-b", "python", ["spark-a has 'python3'", "to 'python3'"]),
    ("missing-interface", without("spark-b", "node_interface"), "spark-b", "node_interface", ["10 GbE port"]),
    ("head-without-address", without("spark-a", "node_address"), "spark-a", "node_address", ["--master-addr"]),
    ("same-address", on("spark-b", node_address="10.0.0.1"), "spark-b", "node_address", ["node spark-a"]),
    ("master-port-on-a-port", big_on(master_port=8012), "spark-a", "master_port", ["engine nemotron's port"]),
    (
        "master-port-on-node-exporter",
        on("spark-b", monitoring={"enabled": True, "port": 29501}),
        "spark-b",
        "master_port",
        ["node_exporter"],
    ),
    (
        "memory-over-every-node",
        big_on(weights_gib=150.0),
        "spark-a",
        "gpu_memory_utilization",
        ["77.50 GiB of weights", "0.55 x 121.0 GiB = 66.55 GiB", "at least 0.65"],
    ),
    (
        "memory-over-the-smaller-node",
        SMALL_NODE,
        "spark-b",
        "gpu_memory_utilization",
        ["32.50 GiB of weights and workspace (weights 60.00 GiB / 2 nodes = 30.00)", "= 27.50 GiB", "at least 0.65"],
    ),
    (
        "memory-with-a-pinned-pool",
        big_on(kv_cache_memory_bytes=40 * GIB),
        "spark-a",
        "gpu_memory_utilization",
        ["+ 40.00 GiB of pinned KV pool", "at least 0.60"],
    ),
    (
        "unknown-node",
        big_on(nodes=["spark-a", "spark-b", "spark-c"]),
        "spark-a",
        "nodes",
        ["'spark-c': no host of this inventory", "(spark-a, spark-b)"],
    ),
    ("node-without-the-engine", on("spark-b", engines=[]), "spark-b", "engines", ["spark-a names this host"]),
    ("other-window", big_on("spark-b", max_model_len=16_384), "spark-b", "max_model_len", ["spark-a has 32768"]),
    (
        "other-commit",
        big_on("spark-b", checkpoint={"repo": "Qwen/Qwen3-32B", "revision": "a" * 40}),
        "spark-b",
        "checkpoint",
        [f"spark-a has {{'repo': 'Qwen/Qwen3-32B', 'revision': '{COMMIT}'"],
    ),
    (
        "a-branch",
        big_on(checkpoint={"repo": "Qwen/Qwen3-32B", "revision": "main"}),
        "spark-b",
        "checkpoint.revision",
        ["two commits", "--resolve"],
    ),
    ("one-node", big_on(nodes=["spark-a"]), "spark-a", "nodes", ["leave nodes empty"]),
    ("a-node-twice", big_on(nodes=["spark-a", "spark-a"]), "spark-a", "nodes", ["names a host twice"]),
    ("headless-in-args", big_on(extra_args=["--headless"]), "spark-b", "extra_args", ["set nodes, master_port"]),
    ("node-rank-in-args", big_on(extra_args=["--node_rank=1"]), "spark-a", "extra_args", ["--node-rank"]),
    ("short-tp-in-args", big_on(extra_args=["-tp=2"]), "spark-a", "extra_args", ["-tp (read as --tensor-parallel"]),
]


@pytest.mark.parametrize(("mutator", "host", "field", "texts"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_a_pair_that_cannot_run_exits_2_naming_host_engine_field_and_fix(pair, capsys, mutator, host, field, texts):
    mutator(pair)
    lines = invalid_lines(pair, capsys)
    named = [line for line in lines if line.startswith(f"  - {host}: engine big: {field} = ")]
    assert named, f"no line names {host}, big and {field}: {lines}"
    assert any(all(text in line for text in texts) and ". Fix: " in line for line in named), named


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("node_interface", "enp1s0f1np1.vlan100", "at most 15"),
        ("nccl_socket_ifname", "en p1", "not an interface name"),
        ("node_address", "127.0.0.1", "not an address the other nodes reach"),
        ("node_address", "0.0.0.0", "not an address the other nodes reach"),
        ("node_address", "spark-b.local", "not an IP address"),
        ("nccl_ib_hca", ["rocep1s0f1;x"], "ibdev2netdev"),
    ],
)
def test_a_network_field_of_the_wrong_shape_names_the_host_and_field(pair, capsys, field, value, text):
    on("spark-b", **{field: value})(pair)
    (line,) = invalid_lines(pair, capsys)
    assert line.startswith(f"  - spark-b: {field} = {value!r}: ") and text in line, line


def test_a_valid_pair_loads_and_every_node_holds_the_engine(pair):
    hosts = loaded(pair)
    assert [engine.name for engine in hosts["spark-b"].config.engines] == ["big"]
    big = hosts["spark-a"].config.engines[1]
    assert (big.tensor_parallel_size, big.head, big.master_port) == (2, "spark-a", 29501)
    assert hosts["spark-a"].config.nccl_ib_hca == ["rocep1s0f1", "roceP2p1s0f1"]
    assert hosts["spark-b"].config.node_address is None


def test_the_memory_problem_names_only_the_node_that_is_over(pair, capsys):
    SMALL_NODE(pair)
    lines = invalid_lines(pair, capsys)
    assert len(lines) == 1 and lines[0].startswith("  - spark-b: engine big: gpu_memory_utilization = 0.55: ")


def test_a_rank_needing_more_than_a_node_gives_is_told_to_span_more_nodes(pair, capsys):
    big_on(weights_gib=240.0)(pair)
    (line, _) = invalid_lines(pair, capsys)
    assert "a rank would need 1.02 of this node (at most 0.95): span more nodes" in line


def test_another_vllm_version_on_a_node(pair, capsys, tmp_path):
    """spark-b pins 0.28.0 with a lock of its own (a lock the schema accepts): a node that fails its own
    rules is compared once it loads, so the lock is there."""
    lock = tmp_path / "vllm-0.28.0.txt"
    lock.write_text((LOCKS / "vllm-0.27.1-cuda-aarch64.txt").read_text().replace("vllm==0.27.1", "vllm==0.28.0"))
    on("spark-b", vllm_version="0.28.0", lock_file=str(lock))(pair)
    lines = invalid_lines(pair, capsys)
    assert lines[0] == (
        "  - spark-b: engine big: vllm_version = '0.28.0': spark-a has '0.27.1': every rank of the engine must run "
        "the same vLLM. Fix: set vllm_version to '0.27.1' on every node of the engine: define it once, in the data of "
        "the group the engine's nodes share."
    )
    assert [line.split(" = ")[0] for line in lines[1:]] == ["  - spark-b: engine big: lock_file"]


def test_two_locks_of_the_same_pin_are_two_vllms(pair, capsys, tmp_path):
    lock = tmp_path / "other.txt"
    lock.write_text(f"# the same pins, locked again\n{(LOCKS / 'vllm-0.27.1-cuda-aarch64.txt').read_text()}")
    on("spark-b", lock_file=str(lock))(pair)
    (line,) = invalid_lines(pair, capsys)
    assert line.startswith(f"  - spark-b: engine big: lock_file = '{lock}': spark-a installs ")
    assert "every rank must run the same packages" in line


def test_an_engine_s_own_vllm_must_be_the_same_on_every_node(pair, capsys):
    """The engine names its own vLLM (0.33.0, the repo's lock) on spark-b only: its pin differs, told once."""
    big_on("spark-b", vllm_version="0.33.0")(pair)
    lines = invalid_lines(pair, capsys)
    assert [line.split(": ")[2].split(" = ")[0] for line in lines] == ["vllm_version", "lock_file"]
    assert "spark-a has '0.27.1': every rank of the engine must run the same vLLM" in lines[0]


def test_an_unknown_node_is_reported_once_on_the_head(pair, capsys):
    big_on(nodes=["spark-a", "spark-b", "spark-c"])(pair)
    assert [line.split(":")[0] for line in invalid_lines(pair, capsys)] == ["  - spark-a"]


def test_a_host_that_holds_the_engine_but_is_no_node(pair, capsys):
    pair["spark-c"] = copy.deepcopy(pair["spark-b"])
    (line,) = invalid_lines(pair, capsys)
    assert line.startswith("  - spark-c: engine big: nodes = ['spark-a', 'spark-b']: this host holds the engine")


def test_two_pairs_may_each_span_an_engine_of_the_same_name(pair):
    pair["spark-c"] = copy.deepcopy(pair["spark-b"]) | {"node_address": "10.0.1.1"}
    pair["spark-d"] = copy.deepcopy(pair["spark-b"])
    big_on("spark-c", nodes=["spark-c", "spark-d"])(pair)
    big_on("spark-d", nodes=["spark-c", "spark-d"])(pair)
    assert set(loaded(pair)) == {"spark-a", "spark-b", "spark-c", "spark-d"}


def test_a_host_that_failed_to_load_is_not_also_reported_missing(pair, capsys):
    on("spark-b", timeout_start_s=60)(pair)
    (line,) = invalid_lines(pair, capsys)
    assert line.startswith("  - spark-b: timeout_start_s = 60: ")


def test_sparkform_plan_of_the_pair_plans_each_node_exits_2_on_mismatch(pair, tmp_path, capsys):
    big_on(model_config_path=str(MODEL_CONFIGS / "qwen3_32b_dense.json"))(pair)  # the inventory lies elsewhere
    inventory = tmp_path / "pair.py"
    inventory.write_text(f"pair = {list(pair.items())!r}\n")
    assert cli.main(["plan", str(inventory)]) == 0
    out = capsys.readouterr().out
    assert "host spark-a:" in out and "host spark-b:" in out
    assert out.count("big: KV from share - weights - overhead") == 2
    assert out.count("this node is one of 2 tensor-parallel ranks") == 2
    pair["spark-b"]["python"] = "python3.12"
    inventory.write_text(f"pair = {list(pair.items())!r}\n")
    with pytest.raises(SystemExit) as caught:
        cli.main(["plan", str(inventory)])
    assert caught.value.code == 2
    assert "  - spark-b: engine big: python = 'python3.12': spark-a has 'python3'" in capsys.readouterr().err


LINK = "10.0.0.0/30"


def rendered(config: HostConfig) -> dict[str, str]:
    return {file.path: file.content for file in render.render_host(config)}


def test_each_node_renders_its_rank_the_head_serving_the_worker_headless(pair):
    hosts = loaded(pair)
    head = hosts["spark-a"].config.spanned({"big": Span("10.0.0.1", "10.0.0.1", LINK)})
    worker = hosts["spark-b"].config.spanned({"big": Span("10.0.0.1", "10.0.0.2", LINK)})
    on_head, on_worker = rendered(head), rendered(worker)
    big = next(engine for engine in head.engines if engine.name == "big")
    env_file, args_file = head.paths.engine_settings("big")
    unit = layout.unit_path(big.unit)
    flags = "--tensor-parallel-size\n2\n--nnodes\n2\n--node-rank\n{}\n--master-addr\n10.0.0.1\n--master-port\n29501\n"
    assert flags.format(0) in on_head[args_file] and "--headless" not in on_head[args_file]
    assert on_worker[args_file].endswith(flags.format(1) + "--headless\n")
    # The head serves through its front and gates on a completion; the worker has neither.
    assert "sparkform-wait-ready" in on_head[unit] and "sparkform-wait-ready" not in on_worker[unit]
    assert "listen 10.0.0.1:8013" not in on_head[layout.FRONT_CONFIG]  # the front listens on the LAN address
    assert ":8013" in on_head[layout.FRONT_CONFIG] and ":8013" not in on_worker[layout.FRONT_CONFIG]
    # The guard probes the head's API and, while the head starts, knows the rank it waits for;
    # on the worker it watches the rank's link to its head.
    guarded = {
        name: {e["name"]: (e["head"], e["ranks"]) for e in json.loads(files[head.paths.guard_config])["engines"]}
        for name, files in (("head", on_head), ("worker", on_worker))
    }
    assert guarded == {
        "head": {"nemotron": (None, None), "big": (None, {"address": "10.0.0.1", "port": 29501, "count": 1})},
        "worker": {"big": (["10.0.0.1", 29501], None)},
    }
    # Each rank's network: its own address, the interfaces exactly, the HCAs, the link allowed.
    assert "VLLM_HOST_IP=10.0.0.1\n" in on_head[env_file] and "VLLM_HOST_IP=10.0.0.2\n" in on_worker[env_file]
    assert "NCCL_SOCKET_IFNAME==enp1s0f1np1\n" in on_head[env_file]
    assert "GLOO_SOCKET_IFNAME=enP2p1s0f1np1\n" in on_worker[env_file]
    assert "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1\n" in on_head[env_file]
    assert "SPARKFORM_NODE_RANK=1\n" in on_worker[env_file]
    assert f"IPAddressAllow=localhost {LINK}\n" in on_worker[unit] and "RemoveIPC=no" in on_worker[unit]
    assert head.paths.vllm_cli in on_worker and head.paths.vllm_cli in on_head
    # The engine of one host beside it renders as before: loopback only, no rank.
    nemotron_env, nemotron_args = head.paths.engine_settings("nemotron")
    assert "VLLM_HOST_IP=127.0.0.1\n" in on_head[nemotron_env] and "--nnodes" not in on_head[nemotron_args]
    assert "IPAddressAllow=localhost\n" in on_head[layout.unit_path(layout.engine_unit("nemotron"))]


def test_a_node_renders_nothing_before_the_deploy_read_its_link(pair):
    with pytest.raises(LookupError, match="big spans"):
        render.render_host(loaded(pair)["spark-b"].config)


def test_a_host_without_a_spanning_engine_renders_no_multi_node_entry(seed_data):
    config = inventory_module.load_host("spark", seed_data, MODEL_CONFIGS).config
    assert config.paths.vllm_cli not in rendered(config)


# --- the preflight: the NodeLink fact's shell run here, on this machine's loopback ---------------


@pytest.fixture
def venv_with_nccl(tmp_path: Path) -> Path:
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "nvidia_nccl_cu12-2.27.3.dist-info").mkdir(parents=True)
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"")
    return tmp_path


def read_link(interface: str, venv: Path, head: tuple[str, int] | None = None) -> nodes.NodeLink:
    output = subprocess.run(
        ["sh", "-c", nodes.node_link_command(interface, str(venv), head)], capture_output=True, text=True, check=True
    ).stdout
    return nodes.parse_node_link(interface, output.splitlines())


def test_preflight_reads_the_interface_nccl_and_whether_the_head_answers(venv_with_nccl):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_port = closed.getsockname()[1]
    link = read_link("lo", venv_with_nccl, ("127.0.0.1", refused_port))
    assert (link.present, link.mtu, link.addresses) == (True, 65536, ())  # loopback has no global address
    assert link.nccl_versions == ("2.27.3",) and link.nccl_libraries[0].endswith("/libnccl.so.2")
    assert link.head == "refused" and link.untrusted == ()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert read_link("lo", venv_with_nccl, listening.getsockname()).head == "open"
    assert read_link("sfnosuch0", venv_with_nccl).present is False


def test_the_preflight_stops_a_node_whose_link_cannot_carry_its_rank(pair, venv_with_nccl):
    hosts = loaded(pair)
    peers = {name: host.config for name, host in hosts.items()}
    worker = hosts["spark-b"].config
    missing = nodes.spans("spark-b", worker, peers, read_link("sfnosuch0", venv_with_nccl))
    assert missing[0] == {} and [(p.host, p.field) for p in missing[1]] == [("spark-b", "node_interface")]
    assert "no such interface" in str(missing[1][0]) and "ip -br link" in str(missing[1][0])
    # Up, but without the address the inventory names; two NCCL libraries in the venv.
    link = nodes.parse_node_link(
        "enP2p1s0f1np1",
        [
            "present",
            "mtu 1500",
            "address 10.0.0.6/30",
            "nccl_dist nvidia_nccl_cu12-2.27.3.dist-info",
            "nccl_dist nvidia_nccl_cu13-2.28.1.dist-info",
            "address $(reboot)",
        ],
    )
    assert link.untrusted == ("address $(reboot)",)
    spans, problems = nodes.spans("spark-b", worker.model_copy(update={"node_address": "10.0.0.2"}), peers, link)
    assert spans == {} and [p.field for p in problems] == ["node_address", "lock_file"]
    assert "has 10.0.0.6/30, not 10.0.0.2" in str(problems[0])
    lines = nodes.preflight_lines("spark-b", worker, link)
    assert any("MTU 1500 below" in line for line in lines) and any("untrusted line" in line for line in lines)
    # The interface's one address stands in for a worker's unset node_address.
    good = nodes.parse_node_link("enP2p1s0f1np1", ["present", "mtu 9000", "address 10.0.0.2/30"])
    assert nodes.spans("spark-b", worker, peers, good) == ({"big": Span("10.0.0.1", "10.0.0.2", LINK)}, [])


# --- the planner's per-node split ----------------------------------------------------------------


def test_a_node_holds_half_the_weights_and_its_part_of_the_pool(pair):
    """By hand: 0.55 x 121 GiB = 66.55 GiB on each node; 60 / 2 = 30 GiB of weights + 2.5 GiB of
    workspace leave 34.05 GiB of KV. Qwen3-32B caches 64 layers x 8 KV heads x 128 x 2 (K, V) x 2
    bytes = 256 KiB a token; a rank holds 4 of the 8 heads, 128 KiB, so a 16-token block of its 64
    layers is 2 MiB: 17,433 whole blocks in 34.05 GiB, 16 tokens each = 278,928 tokens of the
    engine, 8,192 a GiB of one rank's pool (twice one GPU's 4,096)."""
    for node in loaded(pair).values():
        (big,) = [plan for plan in planner.plan(node).engines if plan.name == "big"]
        assert big.tensor_parallel == 2
        assert big.share_gib == pytest.approx(66.55)
        assert big.weights_gib == 30.0
        assert big.non_kv_gib == 32.5
        assert big.kv_gib == pytest.approx(34.05)
        assert big.tokens_per_gib == 8192
        assert big.pool_tokens == 278_928
        assert big.concurrency == pytest.approx(278_928 / 32_768)


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("weights", [7.5, 60.0, 123.4])
def test_the_nodes_weight_shares_sum_to_the_weights(pair, ranks, weights):
    nodes = [f"spark-{i}" for i in range(ranks)]
    data = {
        name: {
            "vllm_version": pair["spark-b"]["vllm_version"],
            "node_interface": "enp1s0f1np1",
            "node_address": f"10.0.0.{i + 1}",
            # Nodes of different sizes: each rank's share is its own node's.
            "memory_total_gib": 121.0 + 8 * i,
            "engines": [{**pair["spark-b"]["engines"][0], "nodes": nodes, "weights_gib": weights}],
        }
        for i, name in enumerate(nodes)
    }
    plans = [planner.plan(host).engines[0] for host in loaded(data).values()]
    assert sum(plan.weights_gib for plan in plans) == pytest.approx(weights)
    for plan, host in zip(plans, data.values(), strict=True):
        assert plan.share_gib == pytest.approx(0.55 * host["memory_total_gib"])
        assert plan.kv_gib + plan.non_kv_gib == pytest.approx(plan.share_gib)


@pytest.mark.parametrize(
    ("config", "ranks"),
    [
        ("qwen3_32b_dense.json", 2),
        ("qwen3_32b_dense.json", 8),
        ("dense_gqa_llama.json", 4),
        ("qwen3_5_hybrid.json", 2),
        ("qwen3_5_hybrid.json", 4),
        ("nemotron_h_mamba.json", 2),
    ],
)
def test_a_ranks_pool_holds_its_part_of_every_token(config, ranks):
    """What TP ranks cache of an engine's pool together is what one GPU would cache in all of their
    memory: the KV pool per node is the pool / TP."""
    model = modelconfig.load(MODEL_CONFIGS / config)
    geometry = modelconfig.geometry(model)
    per_rank = geometry.rank(ranks)
    assert per_rank.bytes_per_token(2) * ranks == geometry.bytes_per_token(2)
    one_gpu, one_rank = geometry.layout(2, 32_768), per_rank.layout(2, 32_768)
    node_kv = 20.25 * GIB
    assert one_rank.pool_tokens(node_kv) == one_gpu.pool_tokens(node_kv * ranks)


def test_fewer_kv_heads_than_ranks_are_copied_to_every_rank():
    geometry = modelconfig.geometry(modelconfig.load(MODEL_CONFIGS / "qwen3_32b_dense.json"))
    assert geometry.rank(16).kv_heads == 1
    assert geometry.rank(1) is geometry


def test_an_engine_of_one_host_plans_as_one_rank(seed_data, make_host):
    plans = planner.plan(make_host(seed_data))
    assert {plan.tensor_parallel for plan in plans.engines} == {1}
    assert "tensor-parallel" not in planner.format_plan(plans)


def test_the_new_fields_are_in_the_field_table():
    table = field_table()
    for label in ("node_interface", "node_address", "nccl_socket_ifname", "gloo_socket_ifname", "nccl_ib_hca"):
        assert f"| `{label}` |" in table
    assert "| `engines[].nodes` | `[]` |" in table and "| `engines[].master_port` | `29501` |" in table
