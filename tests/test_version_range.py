"""setup.cfg's torch range is the latest five minors, and CI tests its floor, its newest installable and the pin."""

import configparser
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORTED_MINORS = 5


def torch_requirement() -> str:
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in setup["options"]["install_requires"].splitlines()]
    (requirement,) = [line for line in lines if re.match(r"torch\b", line)]
    return requirement


def ci_variable(name: str) -> str:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        (value,) = re.findall(rf'^{name}="?([0-9. ]+)"?$', f.read(), re.MULTILINE)
    return value


def release(version: str) -> tuple[int, ...]:
    parts = tuple(int(part) for part in version.split("."))
    return parts + (0,) * (3 - len(parts))


def test_torch_is_the_latest_five_minors_and_ci_tests_the_floor_the_pin_and_the_newest():
    requirement = torch_requirement()
    match = re.fullmatch(r"torch>=([0-9.]+),<([0-9.]+)", requirement)
    assert match, f"setup.cfg should require torch as a range '>=FLOOR,<CEILING', not {requirement!r}"
    floor, ceiling = (release(v) for v in match.groups())
    assert ceiling[0] == floor[0], f"{requirement!r} should stay within one major"
    assert ceiling[1] - floor[1] == SUPPORTED_MINORS, f"{requirement!r} should admit exactly {SUPPORTED_MINORS} minors"
    tested = sorted(release(v) for v in [ci_variable("TORCH_MAIN"), *ci_variable("TORCH_RANGE").split()])
    assert tested[0] == floor, f".ci/run should test the floor of {requirement!r}, tests {tested}"
    assert all(floor <= v < ceiling for v in tested)
    # The newest minor CI's Python 3.11 can install: 2.15 needs Python 3.12.
    assert tested[-1][:2] >= (ceiling[0], ceiling[1] - 2)
