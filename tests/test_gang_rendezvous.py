"""The tests' gang rendezvous (``tests/gang_rendezvous.py``) holds its port from the moment the OS picks it until
the gang is done: no other process can bind it in between, as one could when a port was picked, released and
handed to the ranks to bind again."""

from __future__ import annotations

import errno
import socket

import pytest

from gang_rendezvous import HOST, listening_store


def test_the_store_holds_its_port_while_the_gang_runs_and_frees_it_after():
    import torch.distributed as dist

    with listening_store() as addr:
        host, port = addr.rsplit(":", 1)
        assert host == HOST and int(port) > 0
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind((HOST, int(port)))
        assert taken.value.errno == errno.EADDRINUSE
        client = dist.TCPStore(HOST, int(port), is_master=False)      # a rank joins as a client of it
        client.set("seen", "yes")
        assert client.get("seen") == b"yes"
        del client
    with socket.socket() as other:
        other.bind((HOST, int(port)))
