"""setup.cfg's torch range is the latest five minors, and CI tests its floor, its ceiling and the pin."""

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


def test_torch_is_the_latest_five_minors_and_ci_tests_the_floor_the_pin_and_the_ceiling():
    requirement = torch_requirement()
    match = re.fullmatch(r"torch>=([0-9.]+),<([0-9.]+)", requirement)
    assert match, f"setup.cfg should require torch as a range '>=FLOOR,<CEILING', not {requirement!r}"
    floor, ceiling = (release(v) for v in match.groups())
    assert ceiling[0] == floor[0], f"{requirement!r} should stay within one major"
    assert ceiling[1] - floor[1] == SUPPORTED_MINORS, f"{requirement!r} should admit exactly {SUPPORTED_MINORS} minors"
    tested = {name: release(ci_variable(name)) for name in ("TORCH_MAIN", "TORCH_FLOOR", "TORCH_CEILING",
                                                            "TORCH_NEWEST_PY311")}
    assert all(floor <= v < ceiling for v in tested.values()), (requirement, tested)
    assert tested["TORCH_FLOOR"] == floor, f".ci/run should test the floor of {requirement!r}, tests {tested}"
    newest_minor = (ceiling[0], ceiling[1] - 1)
    assert tested["TORCH_CEILING"][:2] == newest_minor, f".ci/run should test torch {newest_minor}, tests {tested}"
    # Where CI finds no Python 3.12 (which 2.15 needs), the newest minor with a wheel for Python 3.11.
    assert tested["TORCH_NEWEST_PY311"][:2] == (ceiling[0], ceiling[1] - 2), tested
