"""setup.cfg's torch floor is the version CI installs, so the range never claims an untested release."""

import configparser
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_requirement() -> str:
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in setup["options"]["install_requires"].splitlines()]
    (requirement,) = [line for line in lines if re.match(r"torch\b", line)]
    return requirement


def ci_torch_pin() -> str:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        pins = re.findall(r"pip install [^\n]*\btorch==([0-9][0-9.]*)", f.read())
    assert len(pins) == 1, f".ci/run should install exactly one pinned torch, found {pins}"
    return pins[0]


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_torch_is_a_range_whose_floor_is_the_version_ci_installs():
    requirement = torch_requirement()
    match = re.fullmatch(r"torch>=([0-9.]+),<([0-9.]+)", requirement)
    assert match, f"setup.cfg should require torch as a range '>=FLOOR,<CEILING', not {requirement!r}"
    floor, ceiling = match.groups()
    pin = ci_torch_pin()
    # 2.13 and 2.13.0 are the same floor.
    assert release(floor) + (0,) * (3 - len(release(floor))) == release(pin), (
        f"setup.cfg's floor torch>={floor} differs from the torch=={pin} that .ci/run tests"
    )
    assert release(pin) < release(ceiling)
