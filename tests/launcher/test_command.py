"""launcher.command.resolve_command and its helpers: the script / -m checks, called directly (cwd is tmp_path)."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from distamp.launcher import command
from distamp.launcher.command import resolve_command
from distamp.launcher.usage import UsageError

BAD = "import os\n\ndef f(:\n    pass\n"


def ns(script=None, script_args=(), module=False):
    return argparse.Namespace(script=script, script_args=list(script_args), module=module)


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    (tmp_path / "bad.py").write_text(BAD)
    pkg = tmp_path / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('must not be imported')\n")
    (pkg / "good.py").write_text("x = 1\n")
    (pkg / "bad.py").write_text(BAD)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "__main__.py").write_text("def g(:\n")
    (tmp_path / "plain.py").write_text("y = 2\n")
    return tmp_path


def test_script_and_arguments_are_kept_verbatim(here):
    assert resolve_command(ns("train.py", ["--lr", "$x", "-m"])) == ("train.py", "--lr", "$x", "-m")


def test_module_and_arguments(here):
    assert resolve_command(ns("pkgx.good", ["a"], module=True)) == ("-m", "pkgx.good", "a")


def test_missing_script():
    message = (r"^missing the training script: usage is distrun \[options\] SCRIPT \[ARGS\.\.\.\] "
               r"or distrun \[options\] -m MODULE \[ARGS\.\.\.\]\.$")
    with pytest.raises(UsageError, match=message):
        resolve_command(ns())


def test_missing_module_name():
    with pytest.raises(UsageError, match=r"^-m needs a module name, e\.g\. distrun -m package\.train --lr 0\.1\.$"):
        resolve_command(ns(module=True))


@pytest.mark.parametrize(("name", "what"), [("nope.py", "does not exist"), ("pkgx", "is a directory")])
def test_script_that_is_not_a_file(here, name, what):
    message = (rf"^training script '{name}' {what} \(looked from {re.escape(repr(os.getcwd()))}\); give the path "
               r"of a Python file, or use -m MODULE to run a module\.$")
    with pytest.raises(UsageError, match=message):
        resolve_command(ns(name))


def test_script_syntax_error_names_file_line_and_text(here):
    message = (r"^training script 'bad\.py' has a syntax error \(bad\.py, line 3: 'def f\(:'\): .+\. "
               r"Fix it and run distrun again; no worker was started\.$")
    with pytest.raises(UsageError, match=message):
        resolve_command(ns("bad.py"))


@pytest.mark.parametrize(
    ("name", "path"),
    [("pkgx.bad", "pkgx/bad.py, line 3: 'def f\\(:'"), ("pkgx.sub", "pkgx/sub/__main__.py, line 1: 'def g\\(:'")],
)
def test_module_syntax_error_names_its_file(here, name, path):
    message = rf"^-m '{re.escape(name)}' has a syntax error \(.*/{path}\): "
    with pytest.raises(UsageError, match=message):
        resolve_command(ns(name, module=True))


@pytest.mark.parametrize("name", ["no_such_modulex", "pkgx..good", "1pkg", "pkgx.", "plain.sub", ""])
def test_module_that_cannot_be_found(here, name):
    message = (rf"^-m {re.escape(repr(name))}: no module of that name can be imported here; check the name and "
               r"that its package is installed or on PYTHONPATH\.$")
    with pytest.raises(UsageError, match=message):
        resolve_command(ns(name, module=True))


@pytest.mark.parametrize(("name", "problem"), [
    ("pkgx.missing", r"package 'pkgx' \(.*pkgx\) has no module or subpackage 'missing'; check the name"),
    ("pkgx.sub.nope.deeper", r"package 'pkgx\.sub' \(.*sub\) has no module or subpackage 'nope'; check the name"),
    ("pkgx", r"'pkgx' is a package without a __main__ module \(.*pkgx\), so python -m cannot run it; "
             r"name the module to run inside it: -m pkgx\.MODULE"),
    ("json", r"'json' is a package without a __main__ module .*: -m json\.MODULE"),
])
def test_what_python_m_cannot_run_is_refused_before_any_worker(here, name, problem):
    """What every worker would fail on with "No module named ..." after the rendezvous."""
    with pytest.raises(UsageError, match=rf"^-m {re.escape(repr(name))}: {problem}\. No worker was started\.$"):
        resolve_command(ns(name, module=True))


def test_packages_that_may_hold_modules_elsewhere_are_left_to_the_worker(here):
    """A package that extends __path__ at import time, or a namespace package, may
    hold the module in a directory only its import reveals."""
    (here / "ext").mkdir()
    (here / "ext" / "__init__.py").write_text(
        "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n")
    (here / "nspkg").mkdir()
    (here / "nspkg" / "mod.py").write_text("z = 3\n")
    assert resolve_command(ns("ext.elsewhere", module=True)) == ("-m", "ext.elsewhere")
    assert resolve_command(ns("ext", module=True)) == ("-m", "ext")
    assert resolve_command(ns("nspkg.elsewhere", module=True)) == ("-m", "nspkg.elsewhere")
    assert resolve_command(ns("nspkg.mod", module=True)) == ("-m", "nspkg.mod")


def test_find_module_does_not_import_parents(here):
    spec = command._find_module("pkgx.good")
    assert spec.name == "pkgx.good"
    assert spec.origin == str(here / "pkgx" / "good.py")
    assert command._find_module("pkgx.missing").name == "pkgx"
    assert command._find_module("plain.sub") is None
    assert command._find_module("no_such_modulex") is None


def test_module_source(here):
    assert command._module_source("pkgx.sub", command._find_module("pkgx.sub")) == str(here / "pkgx/sub/__main__.py")
    assert command._module_source("pkgx.missing", command._find_module("pkgx.missing")) is None
    assert command._module_source("pkgx", command._find_module("pkgx")) is None  # a package without __main__
    assert command._module_source("json", command._find_module("json")) is None  # same: json has no __main__
    assert command._module_source("sys", command._find_module("sys")) is None  # built in: no source file


def test_installed_module_is_found_from_sys_path(here):
    assert resolve_command(ns("json.tool", module=True)) == ("-m", "json.tool")


def test_compile_check_reports_unreadable_files(here):
    with pytest.raises(UsageError, match=r"^the thing cannot be read: Is a directory\.$"):
        command._check_compiles(str(here / "pkgx"), "the thing")


def test_null_bytes_are_a_usage_error(here):
    (here / "nul.py").write_bytes(b"x = 1\0\n")
    with pytest.raises(UsageError, match=r"^training script 'nul\.py' (has a syntax error|cannot be compiled)"):
        resolve_command(ns("nul.py"))


def test_syntax_warnings_do_not_fail(here):
    (here / "warn.py").write_text("assert (1, 'always true')\nx = '\\d'\n")
    assert resolve_command(ns("warn.py")) == ("warn.py",)
