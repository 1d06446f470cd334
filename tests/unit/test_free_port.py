"""free_port picks listening ports where no outgoing connection can take them first."""

from __future__ import annotations

import socket

import pytest

from gpusched.infra import embedded
from gpusched.infra.embedded import free_port


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_is_below_the_ephemeral_range_and_free() -> None:
    low = embedded._ephemeral_range()[0]
    ports = {free_port() for _ in range(20)}

    # Port 0 would have given ports of the ephemeral range, the one client sockets use.
    assert all(embedded._LOWEST_PICKED <= port < low for port in ports), (low, ports)
    assert len(ports) > 1  # spread, not one port handed to every caller
    for port in ports:
        _bind(port)


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Only the taken port is drawn: every pick fails, the kernel's choice is taken.
        monkeypatch.setattr(embedded._picker, "randrange", lambda *_: taken)

        port = free_port()

        assert port != taken
        _bind(port)


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(embedded, "_ephemeral_range", lambda: (1024, 65535))

    port = free_port()

    assert port > 0
    _bind(port)
