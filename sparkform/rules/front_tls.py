"""The front's TLS: the owner's certificate, or a self-signed one made once and kept, the files
that carry it to the host, and its fingerprint read back.

Pure (cryptography, the library paramiko already brings): the deploy's plan decides with it,
the deploy, `sparkform status` and `sparkform cert` print the certificate's fingerprint.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sparkform.domain import layout
from sparkform.domain.rendered import RenderedFile, Secret
from sparkform.domain.schema import HostConfig
from sparkform.readers.remote import plain_file
from sparkform.readers.snapshot import Snapshot

# A certificate as sparkform writes it, and as it accepts one read back: PEM blocks only.
PEM_CERTIFICATES = re.compile(
    r"(-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]{64,16384}-----END CERTIFICATE-----\n){1,8}"
)
CERTIFICATE_BYTES = 65536
SELF_SIGNED_DAYS = 3650
# A self-signed certificate this close to its end is made anew (its clients must trust the new one).
RENEW_BEFORE_DAYS = 30
# Names every self-signed certificate holds: the host's own requests reach the front there.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class BadCertificate(ValueError):
    """A certificate or key that cannot serve the front, with why."""


@dataclass(frozen=True)
class FrontCertificate:
    """The certificate the front serves and, when this run writes one, its key."""

    pem: str  # the certificate, then its chain
    key_pem: str | None  # None: the host's key stays (a kept self-signed certificate)
    origin: str  # which it is, in words: the owner's, the host's self-signed one kept, or a new one

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.pem)

    @property
    def public_key_pem(self) -> str:
        return (
            leaf(self.pem)
            .public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            .decode()
        )


def leaf(pem: str) -> x509.Certificate:
    """The first certificate of `pem` (the server's own); BadCertificate when there is none."""
    if not PEM_CERTIFICATES.fullmatch(pem):
        raise BadCertificate("not PEM certificates (-----BEGIN CERTIFICATE----- blocks, the server's first)")
    try:
        return x509.load_pem_x509_certificates(pem.encode())[0]
    except ValueError as err:
        raise BadCertificate(f"not a certificate that can be read: {err}") from None


def fingerprint(pem: str) -> str:
    """SHA-256 of the server's certificate, as browsers and `openssl x509 -fingerprint -sha256` show it."""
    return ":".join(f"{byte:02X}" for byte in leaf(pem).fingerprint(hashes.SHA256()))


def names_of(certificate: x509.Certificate) -> set[str]:
    """The DNS names and addresses in the certificate's subjectAltName."""
    try:
        alt = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(alt.get_values_for_type(x509.DNSName)) | {str(a) for a in alt.get_values_for_type(x509.IPAddress)}


def self_signed_names(node: str | None, listen_address: str, extra: list[str]) -> list[str]:
    """What a self-signed certificate of this host holds: its inventory name, its listen address
    (unless a wildcard), `extra` and the local names, each once, in order."""
    names = [node] if node else []
    if not ipaddress.ip_address(listen_address).is_unspecified:
        names.append(listen_address)
    return list(dict.fromkeys([*names, *extra, *LOCAL_NAMES]))


def general_name(name: str, subtree: bool = False) -> x509.GeneralName:
    """A DNS name or an IP address; as a name constraint's `subtree`, an address is the network
    of that one address (/32, /128)."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return x509.DNSName(name)
    return x509.IPAddress(ipaddress.ip_network(address) if subtree else address)


def make_self_signed(names: list[str], now: datetime.datetime) -> FrontCertificate:
    """A new P-256 key and a certificate for `names` signed by it, valid SELF_SIGNED_DAYS: its own
    authority (CA:TRUE, so a client can trust this one certificate and nothing else), constrained to
    `names`: a client that trusts it trusts nothing its key signs for another name, should the key
    leak."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    public = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName([general_name(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.NameConstraints([general_name(n, subtree=True) for n in names], None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    return FrontCertificate(pem, key_pem, "a self-signed certificate made by this run")


def keeps(pem: str | None, names: list[str], now: datetime.datetime) -> bool:
    """Whether the host's certificate is a self-signed one that still serves `names`: made by a
    deploy for exactly these names, and not within RENEW_BEFORE_DAYS of its end."""
    if pem is None:
        return False
    try:
        certificate = leaf(pem)
    except BadCertificate:
        return False
    return (
        certificate.issuer == certificate.subject
        and names_of(certificate) == set(names)
        and certificate.not_valid_after_utc - now > datetime.timedelta(days=RENEW_BEFORE_DAYS)
    )


# What Debian's nginx loads (OpenSSL 3 at its default security level 2): keys of at least these
# bits, and no MD5 or SHA-1 signature on a certificate that another signed ("ee key too small",
# "ca key too small", "ca md too weak" at nginx's reload, after the deploy changed the host).
MIN_KEY_BITS = {"RSA": 2048, "EC": 224}
WEAK_SIGNATURE_HASHES = ("md5", "sha1")


def nginx_refuses(certificates: list[x509.Certificate]) -> str | None:
    """Why nginx would refuse to load this chain (the server's certificate first), or None."""
    for position, certificate in enumerate(certificates):
        which = "the certificate" if position == 0 else f"certificate {position + 1} of the chain"
        public = certificate.public_key()
        for cls, name in ((rsa.RSAPublicKey, "RSA"), (ec.EllipticCurvePublicKey, "EC")):
            if isinstance(public, cls) and public.key_size < MIN_KEY_BITS[name]:
                return (
                    f"{which} has a {public.key_size}-bit {name} key; nginx (OpenSSL at security level 2) loads "
                    f"{MIN_KEY_BITS[name]} bits and more"
                )
        algorithm = certificate.signature_hash_algorithm
        if certificate.issuer != certificate.subject and algorithm and algorithm.name in WEAK_SIGNATURE_HASHES:
            return f"{which} is signed with {algorithm.name.upper()}, which nginx (OpenSSL at security level 2) refuses"
    return None


def owners_certificate(cert_pem: str, key_pem: str) -> FrontCertificate:
    """The owner's certificate and key, checked: the key must be the certificate's, nginx must be
    able to load the chain, and the certificate must not have ended. BadCertificate says what is
    wrong."""
    certificate = leaf(cert_pem)
    if why := nginx_refuses(x509.load_pem_x509_certificates(cert_pem.encode())):
        raise BadCertificate(why)
    try:
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    except (ValueError, TypeError) as err:
        raise BadCertificate(f"key_file is not an unencrypted PEM private key ({err})") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != certificate.public_key().public_bytes(
        serialization.Encoding.DER, spki
    ):
        raise BadCertificate("key_file is not the key of cert_file's certificate (the first in the file)")
    if certificate.not_valid_after_utc < datetime.datetime.now(datetime.UTC):
        raise BadCertificate(f"the certificate ended on {certificate.not_valid_after_utc:%Y-%m-%d}")
    return FrontCertificate(cert_pem, key_pem, "the owner's certificate")


def read_command(path: str) -> str:
    """A shell command that prints the certificate at `path`, bounded; a link is named, never followed."""
    return f"{plain_file(path)} | head -c {CERTIFICATE_BYTES}"


def read_back(lines: list[str], where: str, untrusted: list[str]) -> str | None:
    """The certificate `read_command` printed, when it is PEM certificates (None: nothing there;
    something else is named in `untrusted`)."""
    if not lines:
        return None
    pem = "\n".join(lines) + "\n"
    if PEM_CERTIFICATES.fullmatch(pem):
        return pem
    untrusted.append(f"{where} holds something else than PEM certificates")
    return None


def front_certificate(config: HostConfig, snapshot: Snapshot, now: datetime.datetime) -> FrontCertificate | None:
    """The certificate the front serves over TLS (None: TLS off): the owner's files; else the
    host's self-signed one while it holds the names clients use and has its key; else a new one.
    Off, the host keeps what it has: turned on again, its clients still trust it."""
    if not config.front_tls_on:
        return None
    tls = config.front_tls
    if tls.cert_file and tls.key_file:
        return owners_certificate(
            Path(tls.cert_file).expanduser().read_text(), Path(tls.key_file).expanduser().read_text()
        )
    names = self_signed_names(config.node, config.listen_address, tls.names)
    key = snapshot.paths.get(config.paths.front_tls_key)
    kept = snapshot.front_certificate
    if kept is not None and key is not None and not key.link and keeps(kept, names, now):
        return FrontCertificate(kept, None, "its self-signed certificate, kept")
    return make_self_signed(names, now)


def tls_paths(config: HostConfig) -> list[str]:
    """The front's certificate, its public key and its private key on the host."""
    paths = config.paths
    return [paths.front_certificate, paths.front_public_key, paths.front_tls_key] if config.front_tls_on else []


def tls_files(config: HostConfig, certificate: FrontCertificate | None) -> tuple[list[RenderedFile], list[Secret]]:
    """The front's certificate and public key (public), and its key when this run writes one."""
    if certificate is None:
        return [], []
    paths = config.paths
    files = [
        RenderedFile(paths.front_certificate, certificate.pem, "644"),
        RenderedFile(paths.front_public_key, certificate.public_key_pem, "644"),
    ]
    key = [Secret(paths.front_tls_key, certificate.key_pem, "640", layout.FRONT_USER)] if certificate.key_pem else []
    return files, key
