"""A prefill node checks decode nodes' data-plane certificates against one configured name
instead of each node's address, so one certificate serves nodes whose addresses are not known
when it is made (pods)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pd_cluster.cluster_proof import new_nonce
from pd_cluster.tls import client_context, server_context
from pd_cluster.transfer import ChannelError, ChannelPool, HandshakeRefused
from pd_cluster.transfer.framing import FramedStream, read_frame
from pd_cluster.transfer.handshake import Challenge
from tests.tls_files import TLSFiles, make_tls_files
from tests.transfer.test_transfer import SPEC, TOKEN

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))  # names localhost and 127.0.0.1


@pytest.fixture
async def tls_listener(tls_files: TLSFiles) -> AsyncIterator[str]:
    """A TLS listener on loopback that answers a hello with a challenge it cannot back: a dial that
    gets past the certificate check ends at the proof."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_frame(reader, 5)
            await FramedStream(reader, writer).send(Challenge(node_id="d", nonce=new_nonce(), proof=new_nonce()), 5)
            await asyncio.wait_for(reader.read(), 5)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the dialer hung up during or after the TLS handshake
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_context(tls_files.cert, tls_files.key))
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


def _pool(ca: Path, server_name: str | None) -> ChannelPool:
    return ChannelPool(TOKEN, SPEC, "prefill-0", "cpu", connect_timeout=5, tls=client_context(ca),
                       server_name=server_name)


async def test_the_certificate_is_checked_against_the_configured_name(tls_listener: str, tls_files: TLSFiles) -> None:
    # The certificate names localhost (and 127.0.0.1), not this name: refused at the TLS handshake.
    with pytest.raises(ChannelError, match="(?i)hostname mismatch|CERTIFICATE_VERIFY_FAILED"):
        await _pool(tls_files.ca, "decode.pd-cluster.example").get(tls_listener)
    # A name it holds passes TLS, whatever the address dialed: the dial goes on to the proof.
    with pytest.raises(HandshakeRefused, match="could not prove it holds the cluster token"):
        await _pool(tls_files.ca, "localhost").get(tls_listener)


async def test_without_a_name_the_address_is_checked(tls_listener: str, tls_files: TLSFiles) -> None:
    with pytest.raises(HandshakeRefused, match="could not prove it holds the cluster token"):
        await _pool(tls_files.ca, None).get(tls_listener)  # 127.0.0.1 is in the certificate
