"""The learner's gateway for one sampler ``far``, built as a run builds it, and a self-signed certificate for it: what
the gateway's tests (tests/test_remote_gateway.py, tests/test_gateway_properties.py) start."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from free_ports import free_port

from gepo_plugin.hetero.settings import parse_hetero
from gepo_sampler.relay.signing import generate_pair
from gepo_sampler.remote.protocol import VersionWindow

#: the environment variable holding ``far``'s token (set before Ray starts: tests/remote_hosts.py ray_with_token)
TOKEN_ENV = "GEPO_TEST_GATEWAY_TOKEN"


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key: (certificate file, key file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gepo-gateway-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert, pem = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert), str(pem)


def remote_samplers(tmp_path, monkeypatch, tls: bool = True, **gateway):
    """:class:`RemoteSamplers` for one sampler ``far`` as a run builds them; (them, the CA certificate or None)."""
    from gepo_plugin.verl_glue.hetero.remote.members import RemoteSamplers

    monkeypatch.setenv("GEPO_TEST_KEY", generate_pair()[0])
    cert, key = self_signed(tmp_path) if tls else (None, None)
    hetero = parse_hetero(
        {
            "enable": True,
            "transport": "relay",
            "relay": {"url": str(tmp_path), "run_id": "r", "signing_key_env": "GEPO_TEST_KEY", "public_key": "ab" * 32},
            "remote_samplers": [{"name": "far", "token_env": TOKEN_ENV}],
            "gateway": {"host": "127.0.0.1", "port": free_port(), "certfile": cert, "keyfile": key, **gateway},
        }
    )
    hello = {"run_id": "r", "relay_url": str(tmp_path), "first_version": 0, "learner_version": 0}
    return RemoteSamplers(hetero, 0, VersionWindow(first=0, latest=0), 100, 8, hello, 100_000), cert
