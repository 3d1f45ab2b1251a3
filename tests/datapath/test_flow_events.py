"""Flow events without a wakeup per event.

Frames go through the node's compiled programs with BPF_PROG_TEST_RUN, as if they
arrived on a pod's host veth: every run is a packet the program judges, emits and
counts like any other, and thousands of them take milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket

from services.datapath.maps import eventsmap
from services.datapath.maps.bpf import obj_get, prog_test_run
from services.datapath.types import Enforcement, Verdict
from testkit.datapathnode import Node
from testkit.traffic import TC_ACT_SHOT
from testkit.traffic import tc_frame as frame

#: struct flow_event and the ring's 8-byte record header.
RECORD_BYTES = ctypes.sizeof(eventsmap.FlowEventRecord) + 8


def test_the_reader_is_woken_only_once_a_backlog_builds_up(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [])  # b admits nothing: a's UDP is dropped
    denied = frame(a.v4, b.v4, 40000, 9, socket.IPPROTO_UDP)
    to_b = dp.template.to_container_fd
    ring = obj_get(os.path.join(dp.base_dir, eventsmap.NAME))
    poller = select.epoll()
    try:
        dp.skip_flows(0)
        poller.register(ring, select.EPOLLIN)  # the ring is empty: nothing ready yet
        code, _ = prog_test_run(to_b, denied, b.net.host_ifindex, 10)
        assert code == TC_ACT_SHOT
        assert poller.poll(0.2) == []  # ten events, no wakeup
        assert dp.skip_flows(0) == 10  # yet a read finds them

        mark = eventsmap.wakeup_bytes(dp.config.sizes) // RECORD_BYTES + 2  # the last one sees the mark passed
        prog_test_run(to_b, denied, b.net.host_ifindex, mark)
        assert poller.poll(5.0) != []  # the backlog mark woke the reader
        assert dp.skip_flows(0) == mark
    finally:
        poller.close()
        os.close(ring)


def test_skip_consumes_without_decoding_and_read_decodes(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [])
    to_b = dp.template.to_container_fd
    prog_test_run(to_b, frame(a.v4, b.v4, 40001, 9, socket.IPPROTO_UDP), b.net.host_ifindex, 3)
    assert dp.skip_flows(0) == 3
    assert dp.read_flows(0) == []  # consumed
    prog_test_run(to_b, frame(a.v4, b.v4, 40002, 9, socket.IPPROTO_UDP), b.net.host_ifindex, 2)
    events = dp.read_flows(0)
    assert [(e.source_ip, e.source_port, e.destination_port, e.verdict) for e in events] == [
        (a.v4, 40002, 9, Verdict.DENY)
    ] * 2
    assert dp.skip_flows(0) == 0


def test_take_decodes_up_to_its_limit_and_counts_the_rest(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [])
    dp.skip_flows(0)
    prog_test_run(dp.template.to_container_fd, frame(a.v4, b.v4, 40003, 9, socket.IPPROTO_UDP), b.net.host_ifindex, 10)
    events, skipped = dp.take_flows(0, 3)
    assert [(e.source_port, e.verdict) for e in events] == [(40003, Verdict.DENY)] * 3
    assert skipped == 7
    assert dp.take_flows(0, 3) == ([], 0)  # all consumed
    prog_test_run(dp.template.to_container_fd, frame(a.v4, b.v4, 40004, 9, socket.IPPROTO_UDP), b.net.host_ifindex, 2)
    events, skipped = dp.take_flows(0, 0)  # no limit
    assert len(events) == 2 and skipped == 0
