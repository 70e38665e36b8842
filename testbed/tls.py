"""Certificates for a test's TLS listeners, made with the ``openssl`` command line: a CA of the
test's own, a server certificate it signs (for ``127.0.0.1`` and ``localhost``, so clients verify
the host name as in production), a client certificate for mutual TLS, and, for the refusal tests,
a second CA (``rogue_ca``): a client that trusts only it refuses the server, as one given the
wrong CA file would.

Everything is PEM, which Kafka reads since 2.7 (``ssl.keystore.type=PEM``: the key and its chain
in one file; ``ssl.truststore.type=PEM``: the CA), librdkafka reads as ``ssl.ca.location`` /
``ssl.certificate.location`` / ``ssl.key.location``, and Python's ``ssl`` module (aiokafka, Faust)
reads with ``load_verify_locations`` / ``load_cert_chain``: no Java keystore, no ``keytool``.

    certs = make_certs(tmp_path / "tls")
    certs.ca            # the CA certificate clients trust
    certs.server_pem    # the server's key + certificate + CA, for ssl.keystore.location
    certs.client_cert, certs.client_key
    certs.rogue_ca      # a CA that signed nothing the server presents

Keys are unencrypted (test material only, in the test's temporary directory) and short-lived
(``DAYS``).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Validity of every certificate made here, in days.
DAYS = 7
#: Names the server certificate is valid for (subjectAltName).
SERVER_NAMES = ("IP:127.0.0.1", "DNS:localhost")


class TlsError(RuntimeError):
    """``openssl`` is missing or refused to make a certificate (the message has its output)."""


@dataclass(frozen=True)
class Certs:
    """The files ``make_certs`` wrote (all PEM)."""

    dir: Path
    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    server_pem: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path


def openssl() -> str:
    exe = shutil.which("openssl")
    if exe is None:
        raise TlsError("no openssl command on PATH: install openssl to make test certificates")
    return exe


def _run(*args: str, cwd: Path) -> None:
    res = subprocess.run([openssl(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed (exit {res.returncode}): {(res.stdout + res.stderr).strip()[-2000:]}")


def _key(path: Path) -> None:
    # PKCS#8, unencrypted: what Kafka's PEM keystore, librdkafka and Python's ssl all read.
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path.name, cwd=path.parent)


def _ca(d: Path, name: str, cn: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _key(key)
    _run("req", "-x509", "-new", "-key", key.name, "-sha256", "-days", str(DAYS), "-subj", f"/CN={cn}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-out", cert.name, cwd=d)
    return cert, key


def _signed(d: Path, name: str, cn: str, ca: tuple[Path, Path], ext: list[str]) -> tuple[Path, Path]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    _key(key)
    _run("req", "-new", "-key", key.name, "-subj", f"/CN={cn}", "-out", csr.name, cwd=d)
    extfile.write_text("\n".join(ext) + "\n")
    _run("x509", "-req", "-in", csr.name, "-CA", ca[0].name, "-CAkey", ca[1].name, "-CAcreateserial",
         "-days", str(DAYS), "-sha256", "-extfile", extfile.name, "-out", cert.name, cwd=d)
    csr.unlink()
    extfile.unlink()
    return cert, key


def _server(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path, Path]:
    """The server's certificate, key, and both with the CA in one file (Kafka's PEM keystore)."""
    cert, key = _signed(d, name, "localhost", ca, [
        "basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage=serverAuth", f"subjectAltName={','.join(SERVER_NAMES)}"])
    bundle = d / f"{name}-keystore.pem"
    bundle.write_text(key.read_text() + cert.read_text() + ca[0].read_text())
    return cert, key, bundle


def make_certs(directory: Path | str) -> Certs:
    """A CA, a server and a client certificate it signed, and a second CA that signed neither,
    under ``directory`` (made if missing); ``TlsError`` if ``openssl`` fails."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "ca", "rlstream test CA")
    server_cert, server_key, server_pem = _server(d, "server", ca)
    client_cert, client_key = _signed(d, "client", "rlstream-client", ca, [
        "basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature", "extendedKeyUsage=clientAuth"])
    rogue, _ = _ca(d, "rogue-ca", "a CA that signed nothing here")
    return Certs(d, ca[0], ca[1], server_cert, server_key, server_pem, client_cert, client_key, rogue)
