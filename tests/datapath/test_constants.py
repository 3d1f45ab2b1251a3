"""The numbers the program shares with Python: generated from Python, checked by the compiler;
and the endpoint id bound, derived from the metrics map it comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.datapath.datapath import check_endpoint_id
from services.datapath.fake import FakeDatapath
from services.datapath.loader import (
    PROGRAMS_DIR,
    SOURCE_PATH,
    Loader,
    ProgramConfig,
    program_constants,
    program_source,
    template_hash,
)
from services.datapath.maps import constants, ctmap, metricsmap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Direction, EndpointSpec, Reason

BPF_DIR = SOURCE_PATH.parent


# -- the endpoint id bound -----------------------------------------------------------------------


@pytest.mark.parametrize("metrics", [MapSizes().metrics, 65536 // 2, 4096, 1000, 2 * metricsmap.SLOTS])
def test_the_highest_endpoint_id_is_the_last_whose_slots_all_fit_the_metrics_map(metrics: int) -> None:
    sizes = MapSizes(metrics=metrics)
    most = metricsmap.max_endpoint_id(sizes)
    assert most >= 1
    slots = {metricsmap.slot(most, r, d) for r in Reason for d in Direction}
    assert max(slots) < metrics, "every counter of the highest id has its slot"
    beyond = {metricsmap.slot(most + 1, r, d) for r in Reason for d in Direction}
    assert max(beyond) >= metrics, "the next id would lose counters: the bound is the highest it can be"
    check_endpoint_id(most, sizes)
    with pytest.raises(
        ValueError, match=rf"endpoint id {most + 1} is past {most}, .* metrics map counts \({metrics} slots"
    ):
        check_endpoint_id(most + 1, sizes)


def test_a_metrics_map_too_small_for_one_endpoint_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="metrics map size 16: give at least 32"):
        metricsmap.spec(MapSizes(metrics=metricsmap.SLOTS))


def test_the_fake_datapath_refuses_an_id_past_its_maps_bound(tmp_path: Path) -> None:
    config = ProgramConfig(sizes=MapSizes(metrics=4 * metricsmap.SLOTS))
    dp = FakeDatapath.open(str(tmp_path), config=config)
    try:
        assert dp.max_endpoint_id == 3
        dp.attach_endpoint(EndpointSpec(3, 10, "lxc3", ("10.0.0.3",), 1000))
        with pytest.raises(ValueError, match="endpoint id 4 is past 3"):
            dp.attach_endpoint(EndpointSpec(4, 11, "lxc4", ("10.0.0.4",), 1000))
        assert [e.id for e in dp.pinned_endpoints()] == [3]
    finally:
        dp.teardown()


# -- the shared numbers --------------------------------------------------------------------------


def test_every_shared_number_is_defined_by_the_cflags_and_asserted_in_the_source() -> None:
    shared = program_constants()
    names = [c.name for c in shared]
    assert len(names) == len(set(names))
    cflags = ProgramConfig().cflags("/sys/fs/bpf/x")
    source = program_source()
    for c in shared:
        assert f"-D{c.name}={c.literal}" in cflags
        assert f"_Static_assert({c.name} == {c.literal}, " in source
    assert "-DHINTS_VALID=2147483648U" in cflags, "a flag past int's range stays unsigned, as 1u << 31 was"
    for expected in ("DIR_EGRESS", "VERDICT_DENY", "REASON_NO_PORT", "CT_F_HAIRPIN", "METRICS_SLOTS", "FAMILY_V6"):
        assert expected in names


def test_the_program_defines_none_of_the_shared_numbers_itself() -> None:
    sources = sorted([*BPF_DIR.glob("*.c"), *BPF_DIR.glob("*.h")])
    assert SOURCE_PATH in sources
    for c in program_constants():
        pattern = re.compile(rf"^\s*#\s*define\s+{c.name}\b", re.MULTILINE)
        for path in sources:
            assert not pattern.search(path.read_text()), f"{path.name} defines {c.name}: it comes from Python"


def test_a_changed_number_changes_the_template_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    before = template_hash(program_source(), ProgramConfig().cflags("/sys/fs/bpf/x"))
    monkeypatch.setattr(ctmap, "FLAG_HAIRPIN", 8)
    after = template_hash(program_source(), ProgramConfig().cflags("/sys/fs/bpf/x"))
    assert after != before
    assert "-DCT_F_HAIRPIN=8" in ProgramConfig().cflags("/sys/fs/bpf/x")


def test_a_number_outside_the_programs_fields_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"X \(somewhere\) = 4294967296"):
        constants.Shared("X", 1 << 32, "somewhere")


# -- the compiler checks them --------------------------------------------------------------------


def _compile_error(loader: Loader, capfd: pytest.CaptureFixture[str]) -> str:
    """Build a template that must not compile; the compiler's complaints."""
    with pytest.raises(Exception, match="Failed to compile BPF module"):
        loader.template(ProgramConfig())
    return capfd.readouterr().err


@pytest.mark.root
@pytest.mark.bcc
def test_a_definition_in_the_program_that_differs_from_python_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # As if palisade.c had kept its own copy of a reason, and it had drifted.
    text = SOURCE_PATH.read_text()
    anchor = "#define OUT_HAIRPIN 2   /* a hairpin packet: back into the pod it came from */\n"
    assert anchor in text
    drifted = tmp_path / "palisade.c"
    drifted.write_text(text.replace(anchor, anchor + "#define REASON_DEFAULT_DENY 9\n"))
    for header in BPF_DIR.glob("*.h"):  # the headers it includes, beside it
        (tmp_path / header.name).write_text(header.read_text())
    monkeypatch.setattr("services.datapath.loader.SOURCE_PATH", drifted)
    err = _compile_error(Loader(str(tmp_path / "bpf")), capfd)
    assert "REASON_DEFAULT_DENY: the program says otherwise than types.Reason.DEFAULT_DENY.wire (3)" in err
    assert not (tmp_path / "bpf" / PROGRAMS_DIR).exists(), "no template was pinned"


@pytest.mark.root
@pytest.mark.bcc
def test_a_python_number_the_programs_code_cannot_hold_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(metricsmap, "DIRECTION_SLOTS", 6)
    monkeypatch.setattr(metricsmap, "SLOTS", 12)
    monkeypatch.setattr(ctmap, "FLAG_HAIRPIN", 256)
    err = _compile_error(Loader(str(tmp_path / "bpf")), capfd)
    assert "METRICS_DIR_SLOTS must be a power of two" in err
    assert "CT_F_HAIRPIN must fit the byte the program keeps it in" in err
