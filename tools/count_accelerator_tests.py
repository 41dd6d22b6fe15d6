"""Count, from a junit XML report of the conformance suite run with
``--ctx-device``, the accelerator tests that ran (not skipped) and the rest
of the suite on the device; exit 1 when an accelerator test was skipped.

    python tools/count_accelerator_tests.py REPORT.xml

An accelerator test is one of the suite's ``test_*_accelerators.py`` modules
(marked ``accelerator``: streams, device threads); a skipped one proves
nothing, so CI fails on it, except where a test says the device has one
device only.
"""
import sys
import xml.etree.ElementTree as ET


def count(path):
    ran = skipped = other_ran = other_skipped = 0
    skipped_names = []
    for case in ET.parse(path).getroot().iter("testcase"):
        accelerator = "_accelerators" in case.get("classname", "")
        was_skipped = case.find("skipped") is not None
        if accelerator:
            if was_skipped:
                skipped += 1
                skipped_names.append(f"{case.get('classname')}::{case.get('name')}")
            else:
                ran += 1
        elif was_skipped:
            other_skipped += 1
        else:
            other_ran += 1
    return ran, skipped, other_ran, other_skipped, skipped_names


def main(argv):
    ran, skipped, other_ran, other_skipped, skipped_names = count(argv[1])
    print(
        f"accelerator tests run on the device: {ran} ({skipped} skipped); "
        f"the rest of the suite on the device: {other_ran} run, {other_skipped} skipped or xfailed (CPU only by nature, the release's route, or upstream deviations)"
    )
    for name in skipped_names:
        print(f"SKIPPED accelerator test {name}")
    return 1 if skipped or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
