"""A layout verdict is data read from a file, never trusted as an address.

On torch 2.6-2.12 the boxed-grads path writes into PyNode's vtable, found
at the offset the layout probe recorded in the verdict's facts. A damaged
offset (the right one + 8, 0, ``true``, 2**64) neither kills the importer
nor raises out of the import: an offset is checked to lie in
libtorch_python's readable segments, and the RTTI found through it is
checked, before anything is read through it; one that is not PyNode's
vtable means "probe again", and the import goes on with every member.
"""
import json

import pytest

from support import python
from test_layout_verdict import BACKPORTED, FEATURES, copied_build  # noqa: F401  (copied_build: a fixture)
from _torch_ctxext_build import layout_verdict
from torch_ctxext._ext import loader

needs_boxed_path = pytest.mark.skipif(
    "apply_boxed" not in BACKPORTED, reason="boxed grads are native on this torch: no vtable offset is read"
)


def damaged_offsets():
    right = loader.verdict["facts"]["pynode_vtable_offset"]
    return {"+8": right + 8, "-8": right - 8, "0": 0, "true": True, "2**64": 2**64, "-1": -1,
            "text": "0x10", "float": float(right), "1<<39": 1 << 39, "null": None}


@needs_boxed_path
@pytest.mark.parametrize("damage", ["+8", "-8", "0", "true", "2**64", "-1", "text", "float", "1<<39", "null"])
def test_a_damaged_vtable_offset_is_probed_again_not_a_crash(copied_build, damage):
    cache, build = copied_build
    library = build / "_C.so"
    path = build / layout_verdict.verdict_name(str(library))
    record = json.loads(json.dumps(loader.verdict))
    record["facts"]["pynode_vtable_offset"] = damaged_offsets()[damage]
    path.write_text(json.dumps(record))
    result = python(code=FEATURES, TORCH_CTXEXT_CACHE=cache)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "verifying that its extension reads the structures" in result.stderr
    features = json.loads(result.stdout)
    assert {m: features[m] for m in BACKPORTED} == {m: "torch_ctxext" for m in BACKPORTED}
    kept = json.loads(path.read_text())
    assert kept["facts"]["pynode_vtable_offset"] == loader.verdict["facts"]["pynode_vtable_offset"]


@needs_boxed_path
def test_the_extension_tells_pynodes_vtable_from_any_other_offset_without_reading_outside_the_library():
    """In this process (the boxed path installed): the right offset is
    PyNode's vtable; every other one is refused, none crashes, whatever
    lies there (the library's start, its ELF header, another vtable,
    unmapped gaps, beyond its end)."""
    ext = loader.load()
    right = loader.verdict["facts"]["pynode_vtable_offset"]
    assert ext.is_pynode_vtable_offset(right)
    others = [8, 16, right + 8, right - 8, right + 16, right - 4096, right + 4096, 1 << 30, (1 << 40) - 8]
    others += list(range(8, 1 << 24, 65536 + 8))  # the library's code and data, a few hundred places
    assert [o for o in others if ext.is_pynode_vtable_offset(o)] == []
    for refused in (0, -8, 1 << 40, 2**62):
        assert not ext.is_pynode_vtable_offset(refused)


def test_read_refuses_what_cannot_be_an_offset(tmp_path):
    path = tmp_path / "layout.json"
    for value, kept in [(4096, True), (True, False), (0, False), (-8, False), (2**64, False), (12, False),
                        ("4096", False), (4096.0, False), (None, False)]:
        path.write_text(json.dumps({"format": layout_verdict.FORMAT, "found": {}, "facts": {"pynode_vtable_offset": value}}))
        assert (layout_verdict.read(str(path)) is not None) == kept, value
    path.write_text(json.dumps({"format": layout_verdict.FORMAT, "found": {}, "facts": {}}))
    assert layout_verdict.read(str(path)) is not None  # no offset (2.13 on): nothing to check

