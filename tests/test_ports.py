"""Ports and kernel sockets (fsdp_course.runtime.ports): outside the ephemeral range, no TCP port for kernels."""

from __future__ import annotations

import socket

import pytest
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, start_new_kernel

from fsdp_course.runtime.ports import _ephemeral_start, free_port, kernel_transport


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random, so two parallel callers rarely meet
    for port in ports:
        assert 1024 < port < _ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_from_a_start_skips_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        assert free_port(port, tries=10) > port
    with pytest.raises(ValueError, match="1..65535"):
        free_port(70000)


def test_kernel_transport_gives_each_kernel_its_own_socket_path() -> None:
    a, b = kernel_transport(), kernel_transport()
    assert a["transport"] == b["transport"] == "ipc"
    assert a["ip"] != b["ip"] and len(a["ip"]) < 90


def test_nbval_kernels_use_unix_sockets() -> None:
    km, kc = start_new_kernel(kernel_name=CURRENT_ENV_KERNEL_NAME)  # what nbval calls (patched in conftest)
    try:
        assert km.transport == "ipc"
        reply = kc.execute_interactive("x = 6 * 7", timeout=30)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
