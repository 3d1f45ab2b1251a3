"""The subject layout: one place builds every subject and filter, and they agree with each other."""

from __future__ import annotations

import pytest

from services.common import bus, subjects
from services.common.subjects import (
    IDENTITY_ALL,
    IPCACHE_ALL,
    REGEN_ALL,
    STATUS_SUBJECT_PREFIX,
    SYNCED_SUBJECT,
    identity_subject,
    ipcache_subject,
    k8s_filter,
    k8s_object_kind,
    k8s_subject,
    regen_subject,
    status_subject,
)


@pytest.mark.parametrize(
    ("built", "expected"),
    [
        (k8s_subject("pod", "prod", "web-1"), "palisade.k8s.pod.prod.web-1"),
        (k8s_subject("namespace", "", "prod"), "palisade.k8s.namespace._.prod"),
        (k8s_subject("pod", "a.b", "x y*>"), "palisade.k8s.pod.a_b.x_y__"),
        (k8s_filter(), "palisade.k8s.>"),
        (k8s_filter("networkpolicy"), "palisade.k8s.networkpolicy.>"),
        (SYNCED_SUBJECT, "palisade.k8s.synced"),
        (status_subject("kubernetes"), "palisade.k8s.status.kubernetes"),
        (status_subject("manifests:/a.b"), STATUS_SUBJECT_PREFIX + "manifests:/a_b"),
        (identity_subject(300), "palisade.identity.300"),
        (IDENTITY_ALL, "palisade.identity.>"),
        (ipcache_subject("10.0.0.0/8"), "palisade.ipcache.10_0_0_0_8"),
        (ipcache_subject("fd00::1/128"), "palisade.ipcache.fd00::1_128"),
        (IPCACHE_ALL, "palisade.ipcache.>"),
        (regen_subject("node-1.example"), "palisade.regen.node-1_example"),
        (REGEN_ALL, "palisade.regen.>"),
    ],
)
def test_layout(built: str, expected: str) -> None:
    assert built == expected


@pytest.mark.parametrize(
    ("subject", "kind"),
    [
        (k8s_subject("pod", "prod", "web.1"), "pod"),
        (k8s_subject("ciliumclusterwidenetworkpolicy", "", "x"), "ciliumclusterwidenetworkpolicy"),
        (SYNCED_SUBJECT, None),
        (status_subject("kubernetes"), None),
        (identity_subject(300), None),
        ("other.k8s.pod.a.b", None),
    ],
)
def test_object_kind(subject: str, kind: str | None) -> None:
    assert k8s_object_kind(subject) == kind


def test_streams_cover_their_subjects_and_the_bus_keeps_the_old_names() -> None:
    assert bus.K8S_STREAM.subjects == (k8s_filter(),)
    assert bus.IDENTITY_STREAM.subjects == (IDENTITY_ALL,)
    assert bus.IPCACHE_STREAM.subjects == (IPCACHE_ALL,)
    assert bus.REGEN_STREAM.subjects == (REGEN_ALL,)
    for name in ("SYNCED_SUBJECT", "k8s_subject", "identity_subject", "ipcache_subject", "regen_subject", "token"):
        assert getattr(bus, name) is getattr(subjects, name)
