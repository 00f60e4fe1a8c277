"""Joining a Ray cluster that is not there fails in seconds with the address named (issue #21, item 4):
``ray.init`` itself retries for minutes. The reference is a port this test holds or has just freed."""

from __future__ import annotations

import socket

import pytest

from megarl.errors import ClusterError
from megarl.trainer.cluster import _check_reachable


def test_an_address_nobody_answers_is_named_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once the socket closes: nothing listens there
    with pytest.raises(ClusterError, match=rf"no Ray cluster answers at 127\.0\.0\.1:{port} .*RAY_ADDRESS"):
        _check_reachable(f"127.0.0.1:{port}")


def test_a_listening_address_and_ray_forms_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
    _check_reachable("auto")  # Ray's own resolution
    _check_reachable("ray://head:10001")  # Ray client: Ray's own checks
