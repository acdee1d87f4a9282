"""Real X.509 certificates for the mutual TLS tests, made with the openssl
command line (no Python crypto library is installed): a CA, and leaf
certificates it signs for server and client use, as Helm's genCA and
genSignedCert make them."""

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path

    def env(self, ca: "Cert") -> dict[str, str]:
        """The settings that make a service present this certificate and trust ca."""
        return {"INFERMESH_WORKER__TLS_CERT": str(self.cert), "INFERMESH_WORKER__TLS_KEY": str(self.key),
                "INFERMESH_WORKER__TLS_CA": str(ca.cert)}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> Cert:
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return Cert(cert, key)


def make_cert(folder: Path, ca: Cert, name: str, sans: str = "IP:127.0.0.1,DNS:localhost") -> Cert:
    """A certificate for name signed by ca, for servers and clients alike (as genSignedCert's)."""
    cert, key, csr, ext = (folder / f"{name}{suffix}" for suffix in (".pem", ".key", ".csr", ".ext"))
    ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-days", "2", "-out", str(cert), "-extfile", str(ext))
    return Cert(cert, key)
