"""TLS: a client that trusts the server's certificate gets the engine's tokens; a
plaintext client gets nothing."""

import subprocess

import grpc
import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.serving.client import Client
from jaxfill.serving.server import ServerThread
from serving_util import compile_cache_dir
from fast_engine import REFERENCE_ATTENTION


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    compile_cache_dir(tmp_path_factory)
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    engine = Engine(load_config("tiny_random", REFERENCE_ATTENTION), progress=False)
    # The reference comes first: once the server runs, its engine thread alone may step.
    expected = engine.generate(["Hello TLS"], SamplingParams(max_tokens=6))[0]
    with ServerThread(engine, host="127.0.0.1", port=0, tls_cert=str(cert), tls_key=str(key)) as st:
        assert st.wait_ready(600), "server never became ready"
        yield st, expected, str(cert)


@pytest.mark.slow
def test_tls_client_gets_the_engine_tokens(tls_server):
    st, expected, cert = tls_server
    with Client(st.address, tls_ca=cert, tls_server_name="localhost") as client:
        got = client.generate("Hello TLS", timeout=120, max_tokens=6)
    assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason


def test_plaintext_client_is_refused(tls_server):
    st, _, _ = tls_server
    with Client(st.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
