"""What each worker runs: the training script or ``-m`` module, found and byte-compiled before any worker starts."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import re
import warnings

from distamp.launcher.usage import UsageError

__all__ = ["resolve_command"]

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def resolve_command(args: argparse.Namespace) -> tuple[str, ...]:
    """What each worker runs after ``python -u``: ``(script, *args)`` or ``("-m", module, *args)``."""
    target, rest = args.script, list(args.script_args)
    if args.module:
        if target is None:
            raise UsageError("-m needs a module name, e.g. distrun -m package.train --lr 0.1.")
        spec = _find_module(target) if _MODULE_NAME.match(target) else None
        if spec is None:
            raise UsageError(
                f"-m {target!r}: no module of that name can be imported here; "
                f"check the name and that its package is installed or on PYTHONPATH."
            )
        problem = _cannot_run(target, spec)
        if problem is not None:
            raise UsageError(f"-m {target!r}: {problem}. No worker was started.")
        source = _module_source(target, spec)
        if source is not None:
            _check_compiles(source, f"-m {target!r}")
        return ("-m", target, *rest)
    if target is None:
        raise UsageError(
            "missing the training script: usage is distrun [options] SCRIPT [ARGS...] "
            "or distrun [options] -m MODULE [ARGS...]."
        )
    if not os.path.isfile(target):
        what = "is a directory" if os.path.isdir(target) else "does not exist"
        raise UsageError(
            f"training script {target!r} {what} (looked from {os.getcwd()!r}); "
            f"give the path of a Python file, or use -m MODULE to run a module."
        )
    _check_compiles(target, f"training script {target!r}")
    return (target, *rest)


def _check_compiles(path: str, what: str) -> None:
    """Byte-compile ``path`` so a syntax error stops the launch before any worker starts.

    Every worker would otherwise fail the same way after the rendezvous, and
    the report would name only one of them.
    """
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise UsageError(f"{what} cannot be read: {exc.strerror}.") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings are the worker's to print
            compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or path}, line {exc.lineno}" if exc.lineno else (exc.filename or path)
        code = f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else ""
        raise UsageError(
            f"{what} has a syntax error ({where}{code}): {exc.msg}. Fix it and run "
            f"distrun again; no worker was started."
        ) from None
    except ValueError as exc:  # e.g. null bytes on Python < 3.12
        raise UsageError(f"{what} cannot be compiled: {exc}; no worker was started.") from None


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec ``python -m name`` would run from here, found without importing anything.

    ``importlib.util.find_spec`` would import (run) the parent packages of a
    dotted name, so the path is walked one package at a time. The worker
    runs ``python -m`` from this directory, which puts it first on
    ``sys.path``; distrun's own ``sys.path`` does not have it. Returns
    ``None`` when the top-level package cannot be found; a submodule that
    cannot be found this way (a package that extends ``__path__`` at
    import time) yields the deepest package found.
    """
    parts = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd()])
    if spec is None:
        spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return None
    for i in range(1, len(parts)):
        if spec.submodule_search_locations is None:
            return None  # a plain module has no submodules
        child = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(spec.submodule_search_locations)
        )
        if child is None:
            return spec
        spec = child
    return spec


def _cannot_run(name: str, spec: importlib.machinery.ModuleSpec) -> str | None:
    """Why ``python -m name`` certainly fails to find what to run, or ``None``.

    ``spec`` is what :func:`_find_module` found: ``name`` itself, or its
    deepest package that could be found. Either way it is certain only for a
    regular package whose ``__init__.py`` never mentions ``__path__``: one
    that extends its path at import time (``pkgutil.extend_path``) or a
    namespace package may hold modules elsewhere, which is left to the
    worker to find.
    """
    if spec.submodule_search_locations is None or _may_extend_path(spec):
        return None
    where = os.path.dirname(spec.origin or "")
    if spec.name != name:
        missing = name.split(".")[spec.name.count(".") + 1]
        return f"package {spec.name!r} ({where}) has no module or subpackage {missing!r}; check the name"
    main = importlib.machinery.PathFinder.find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
    if main is None:
        return (f"{name!r} is a package without a __main__ module ({where}), so python -m cannot run it; "
                f"name the module to run inside it: -m {name}.MODULE")
    return None


def _may_extend_path(spec: importlib.machinery.ModuleSpec) -> bool:
    """True unless ``spec`` is a regular package whose ``__init__.py`` does not mention ``__path__``."""
    origin = spec.origin if spec.has_location else None
    if origin is None or os.path.basename(origin) != "__init__.py":
        return True  # a namespace package, or a compiled one
    try:
        with open(origin, "rb") as f:
            return b"__path__" in f.read()
    except OSError:
        return True


def _module_source(name: str, spec: importlib.machinery.ModuleSpec) -> str | None:
    """The ``.py`` file ``python -m name`` runs, or ``None`` when it is not a known source file."""
    if spec.name != name:
        return None  # only a parent package was found: nothing certain to compile
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main_spec = importlib.machinery.PathFinder.find_spec(
            f"{name}.__main__", list(spec.submodule_search_locations)
        )
        if main_spec is None:
            return None
        spec = main_spec
    origin = spec.origin if spec.has_location else None
    return origin if origin is not None and origin.endswith(".py") else None
