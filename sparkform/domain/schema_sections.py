"""The inventory's nested sections (compile_caps, monitoring, scrub, front_tls) and the address
check they share with the host's own fields (sparkform.domain.schema)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator, model_validator

from sparkform.domain.layout import FRONT_TEXTFILE, GPU_TEXTFILE, GUARD_TEXTFILE, RECORD_TEXTFILE
from sparkform.domain.shapes import HOST_NAME, PortNumber, StrictModel, checked_calendar, checked_managed_folder


class CompileCaps(StrictModel):
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


class Monitoring(StrictModel):
    """Debian's prometheus-node-exporter on the host (docs/operator.md, Monitoring); who may scrape it is
    `metrics_allow`."""

    enabled: bool = Field(False)
    """Install prometheus-node-exporter with its systemd collector limited to sparkform's units and textfiles of
    sparkform's (host record, cache keys, cold starts, last converge, the guard's alerts, the GPU's clock-event
    reasons, the front's requests per client)."""
    listen_address: str = Field("127.0.0.1")
    """Address node_exporter listens on (its --web.listen-address); a LAN address or 0.0.0.0 lets `metrics_allow`
    scrape it from the LAN (its unit allows loopback and `metrics_allow` only)."""
    port: PortNumber = Field(9100, ge=1, le=65535)
    """node_exporter's port (Debian's default 9100)."""
    textfile_dir: str = Field("/var/lib/prometheus/node-exporter")
    """node_exporter's textfile collector folder (Debian's default); root's, 0755; sparkform writes sparkform.prom,
    sparkform-guard.prom, sparkform-gpu.prom and sparkform-front.prom into it."""

    @field_validator("listen_address")
    @classmethod
    def _an_address(cls, value: str) -> str:
        return checked_address(value)

    @field_validator("textfile_dir")
    @classmethod
    def _managed_folder(cls, value: str) -> str:
        return checked_managed_folder(value)

    @property
    def record_textfile(self) -> str:
        """The host record's metrics, written with the record."""
        return f"{self.textfile_dir}/{RECORD_TEXTFILE}"

    @property
    def guard_textfile(self) -> str:
        """The guard's alert counts, written by the guard."""
        return f"{self.textfile_dir}/{GUARD_TEXTFILE}"

    @property
    def gpu_textfile(self) -> str:
        """The GPU as NVML reports it, sampled by the guard."""
        return f"{self.textfile_dir}/{GPU_TEXTFILE}"

    @property
    def front_textfile(self) -> str:
        """Requests per client of the front, counted by the guard from the front's access log."""
        return f"{self.textfile_dir}/{FRONT_TEXTFILE}"

    @property
    def textfiles(self) -> list[str]:
        """Every textfile sparkform writes."""
        return [self.record_textfile, self.guard_textfile, self.gpu_textfile, self.front_textfile]


class Scrub(StrictModel):
    """The checkpoint scrub (docs/operator.md, Unattended): sparkform-scrub.timer re-hashes every file of the
    engines' checkpoints against its manifest, at idle I/O priority; a file that no longer matches is reported,
    fetched again, and the engines that serve it are restarted on the good bytes."""

    enabled: bool = Field(True)
    """Run the scrub on its timer; false stops and disables the timer (`systemctl start sparkform-scrub` still runs
    one)."""
    period: str = Field("weekly")
    """When the scrub runs: an OnCalendar= event (weekly, daily, 'Sun *-*-* 03:00'); a run missed while the host was
    off happens after the next boot, once the engines serve."""
    rate_mib_s: int = Field(200, ge=1, le=100_000)
    """The most the scrub reads, in MiB a second (40 GB of checkpoints take 3.5 min at 200); its reads also yield
    to every other read (idle I/O class)."""
    retry_s: int = Field(300, ge=10)
    """A repair whose fetch failed (the hub did not answer) is tried again after this long, doubled each time it fails
    again; once it verifies, its engines start on it without a deploy."""
    retry_max_s: int = Field(21600, ge=10)
    """The longest pause between those tries."""

    @field_validator("period")
    @classmethod
    def _calendar(cls, value: str) -> str:
        return checked_calendar(value)


class FrontTLS(StrictModel):
    """TLS on every port of the front (docs/clients.md, TLS): the owner's certificate, or a self-signed one the
    deploy makes once and keeps."""

    enabled: bool | None = Field(None)
    """True: every front port speaks HTTPS only, and a plain HTTP request gets a 400 that says so (never a redirect);
    False: plain HTTP; None: on when listen_address is not loopback."""
    cert_file: str | None = Field(None)
    """The owner's certificate on the control machine (PEM: the server's certificate first, then its chain); None: a
    self-signed one the deploy makes once and keeps, whose SHA-256 fingerprint the deploy and `sparkform status`
    print (`sparkform cert` prints it for clients to trust)."""
    key_file: str | None = Field(None)
    """The private key of cert_file on the control machine (PEM, chmod 600); root's and the front's group's on the
    host, like the API keys."""
    names: list[str] = Field(default_factory=list)
    """Names and addresses clients reach the host by, besides the inventory's host name and listen_address: the
    self-signed certificate holds them all (and localhost, 127.0.0.1, ::1); a change makes a new one."""

    @field_validator("names")
    @classmethod
    def _names(cls, values: list[str]) -> list[str]:
        for value in values:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                if not HOST_NAME.fullmatch(value) or ".." in value:
                    raise ValueError(
                        f"{value!r} is neither an IP address nor a host name (letters, digits, . - _)"
                    ) from None
        return values

    @model_validator(mode="after")
    def _both_files(self) -> FrontTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "cert_file and key_file go together: set both (the owner's certificate) or neither (a self-signed one)"
            )
        return self


def checked_address(value: str) -> str:
    """An IP address, normalized; ValueError naming the forms that are meant."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address (e.g. 127.0.0.1, 192.168.1.20 or 0.0.0.0)") from None
