"""The Docker images: everything they copy exists and survives .dockerignore; headers say how to use them.

No image is built here (that needs a daemon and the network); these checks
catch what breaks a build most often: a renamed file, an over-eager ignore
pattern, a command that no longer exists.
"""

import configparser
import fnmatch
import glob
import json
import os
import re
import shlex

import pytest

from tests.test_version_range import release, torch_requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILES = ["docker/Dockerfile.cuda", "docker/Dockerfile.cpu"]


def instructions(path: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with continuation lines joined and comments dropped."""
    joined, pending = [], ""
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            stripped = line.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            joined.append(pending + stripped)
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def copy_sources(args: str) -> list[str] | None:
    """Context paths a COPY/ADD reads; ``None`` for a copy from another stage."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1]


def ignore_patterns() -> list[str]:
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        lines = [line.strip() for line in f]
    return [line for line in lines if line and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker would leave ``path`` (or a parent) out of the context (no ``!`` rules used)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("!"):
            pytest.fail(f".dockerignore exception rule {pattern!r} is not modelled by this test; extend it")
        pattern = pattern.strip("/")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.split("/")[-1], pattern[3:]):
                return True
    return False


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_file_exists_and_is_not_ignored(dockerfile):
    patterns = ignore_patterns()
    copies = [copy_sources(args) for keyword, args in instructions(dockerfile) if keyword in ("COPY", "ADD")]
    sources = [src for srcs in copies if srcs is not None for src in srcs]
    assert sources, f"{dockerfile} copies nothing from the context"
    for src in sources:
        matches = glob.glob(os.path.join(ROOT, src))
        assert matches, f"{dockerfile} copies {src!r}, which does not exist in the build context"
        for match in matches:
            rel = os.path.relpath(match, ROOT)
            assert not ignored(rel, patterns), f"{dockerfile} copies {rel!r}, but .dockerignore excludes it"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_header_gives_build_and_run_commands(dockerfile):
    with open(os.path.join(ROOT, dockerfile)) as f:
        header = []
        for line in f:
            if not line.startswith("#"):
                break
            header.append(line)
    text = "".join(header)
    assert f"docker build -f {dockerfile} " in text
    assert "docker run " in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_commands_refer_to_what_the_package_provides(dockerfile):
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    scripts = setup["options.entry_points"]["console_scripts"]
    assert re.search(r"^\s*distrun\s*=", scripts, re.MULTILINE), "setup.cfg no longer installs the distrun script"
    assert "examples" in setup["options.extras_require"]

    cmd = [json.loads(args) for keyword, args in instructions(dockerfile) if keyword == "CMD"]
    assert len(cmd) == 1
    assert cmd[0][0] == "distrun"
    scripts_used = [word for word in cmd[0] if word.endswith(".py")]
    assert scripts_used
    assert all(os.path.exists(os.path.join(ROOT, s)) for s in scripts_used)
    assert any(keyword == "FROM" for keyword, _ in instructions(dockerfile))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_installs_a_torch_inside_setup_cfgs_range(dockerfile):
    """An explicit torch==TORCH_VERSION, not whatever a base image ships (2.5.1 could not run distrun)."""
    steps = instructions(dockerfile)
    args = dict(a.split("=", 1) for keyword, a in steps if keyword == "ARG" and "=" in a)
    version = args.get("TORCH_VERSION")
    assert version, f"{dockerfile} should choose torch with ARG TORCH_VERSION=..."
    assert any('"torch==${TORCH_VERSION}"' in a for keyword, a in steps if keyword == "RUN")
    floor, ceiling = re.fullmatch(r"torch>=([0-9.]+),<([0-9.]+)", torch_requirement()).groups()
    assert release(floor) <= release(version) < release(ceiling), (
        f"{dockerfile} installs torch {version}, outside setup.cfg's torch>={floor},<{ceiling}"
    )


def test_ignore_rules_are_modelled():
    assert ignored("runs/x.json", ["runs"])
    assert ignored("distamp/__pycache__/a.pyc", ["**/__pycache__"])
    assert not ignored("distamp/fleet.py", ["runs", "**/__pycache__", "*.egg-info"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_an_image_with_a_compiler_builds_the_powersgd_kernels_at_build_time(dockerfile):
    """A fresh container must not compile them: the image builds them into a cache it names in ENV."""
    steps = instructions(dockerfile)
    installs_gcc = any(keyword == "RUN" and re.search(r"apt-get install[^&]*\bgcc\b", args) for keyword, args in steps)
    if not installs_gcc:
        with open(os.path.join(ROOT, dockerfile)) as f:
            header = " ".join(line.strip("# \n") for line in f if line.startswith("#"))
        assert "GPU gradients always use torch ops" in header, f"{dockerfile}: say why it builds no kernels"
        return
    copied = next(i for i, (keyword, args) in enumerate(steps) if keyword == "COPY" and "distamp" in args.split())
    cache = [i for i, (keyword, args) in enumerate(steps) if keyword == "ENV" and "DISTAMP_CACHE_DIR=" in args]
    build = [i for i, (keyword, args) in enumerate(steps)
             if keyword == "RUN" and "low_rank_kernels" in args and "load()" in args and "SystemExit" in args]
    assert build, f"{dockerfile} installs gcc but does not build PowerSGD's kernels in a RUN step"
    assert cache, f"{dockerfile}: set ENV DISTAMP_CACHE_DIR for the kernels"
    assert cache[0] < build[0], f"{dockerfile}: set ENV DISTAMP_CACHE_DIR before building the kernels"
    assert copied < build[0]
