"""Bad ``distrun`` input is refused before anything starts: exit 2, a clear message.

Most cases call ``main()`` in-process (nothing can start: validation fails
first); a few run the real console script and ``python -m`` to check the
exit code a shell sees.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from distamp.launcher.cli import _split_argv, build_parser, main, parse_plan
from distamp.launcher.plan import UsageError, build_plan
from distamp.torch_compat import grace_period_supported

SYNTAX_ERROR = "import os\n\ndef f(:\n    pass\n"


@pytest.fixture
def script(tmp_path, monkeypatch):
    """A training script in a fresh working directory (and a script, module
    and package ``__main__`` with a syntax error on line 3)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "bad_syntax.py").write_text(SYNTAX_ERROR)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('distrun must not import the package')\n")
    (tmp_path / "pkg" / "bad_syntax.py").write_text(SYNTAX_ERROR)
    (tmp_path / "pkg" / "__main__.py").write_text(SYNTAX_ERROR)
    return "train.py"


def run_main(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


BAD_INPUT = [
    (["missing.py"], r"training script 'missing.py' does not exist"),
    (["."], r"training script '.' is a directory"),
    ([], r"missing the training script"),
    (["-m", "no_such_module_xyz"], r"-m 'no_such_module_xyz': no module of that name"),
    (["-m", "not a module"], r"-m 'not a module'"),
    (["-m"], r"-m needs a module name"),
    # --gpus on this CPU-only machine: point at --nproc_per_node.
    (["--gpus", "0,1", "train.py"], r"--gpus '0,1': no CUDA GPU is visible.*--nproc_per_node 2"),
    (["--gpus", "0,a", "train.py"], r"--gpus '0,a' is invalid.*got 'a'"),
    (["--gpus", "", "train.py"], r"--gpus '' is invalid"),
    (["--gpus", "1,1", "train.py"], r"--gpus '1,1' lists GPU 1 more than once"),
    (["--gpus", "0,1", "--nproc_per_node", "3", "train.py"],
     r"--gpus '0,1' starts one worker per GPU \(2\).*--nproc_per_node 3.*only one"),
    (["--master", "host", "--nnodes", "2", "train.py"], r"--master 'host' is malformed: expected HOST:PORT"),
    (["--master", ":29500", "--nnodes", "2", "train.py"], r"--master ':29500' is malformed"),
    (["--master", "host:", "--nnodes", "2", "train.py"], r"--master 'host:' is malformed"),
    (["--master", "host:http", "--nnodes", "2", "train.py"], r"--master 'host:http' has port 'http'"),
    (["--master", "host:70000", "--nnodes", "2", "train.py"], r"--master 'host:70000' has port '70000'"),
    (["--master", "host:0", "--nnodes", "2", "train.py"], r"--master 'host:0' has port '0'"),
    (["--master", "ho st:1", "--nnodes", "2", "train.py"], r"--master 'ho st:1' has an invalid host 'ho st'"),
    (["--nnodes", "2", "--master", "h:1", "--node_rank", "2", "train.py"],
     r"--node_rank 2 is out of range: with 2 node\(s\) it must be from 0 to 1"),
    (["--nnodes", "2", "--master", "h:1", "--node_rank", "-1", "train.py"], r"--node_rank -1 is out of range"),
    (["--node_rank", "1", "train.py"], r"--node_rank 1 is out of range: with 1 node"),
    (["--nnodes", "2", "--master", "no-such-host.invalid:29500", "train.py"],
     r"--master 'no-such-host.invalid:29500': the master host 'no-such-host.invalid' cannot be resolved"),
    (["--nnodes", "2", "--master", "192.0.2.250:29500", "train.py"],
     (r"--master '192.0.2.250:29500': node rank 0 hosts the rendezvous, "
      r"but the master '192.0.2.250' is not an address of this host")),
    (["--nnodes", "2", "train.py"], r"--nnodes 2 needs a rendezvous address: add --master HOST:PORT"),
    (["--nnodes", "0", "train.py"], r"--nnodes 0 is invalid: it must be an integer >= 1"),
    (["--nnodes", "two", "train.py"], r"argument --nnodes: invalid int value: 'two'"),
    (["--nproc_per_node", "0", "train.py"], r"--nproc_per_node 0 is invalid: it must be an integer >= 1"),
    (["--max_restarts", "-1", "train.py"], r"--max_restarts -1 is invalid: it must be an integer >= 0"),
    (["--grace_period", "0", "train.py"], r"--grace_period 0 is invalid"),
    (["--tee", "2", "--nproc_per_node", "2", "train.py"], r"--tee '2' names rank 2, but the world size is 2"),
    (["--tee", "first", "train.py"], r"--tee 'first' is invalid: expected 'all', 'none' or"),
    (["--ips", "10.0.0.1,10.0.0.2", "--nnodes", "3", "train.py"],
     r"--nnodes 3 conflicts with --ips '10.0.0.1,10.0.0.2'"),
    (["--ips", "10.0.0.1,10.0.0.2", "--master", "10.0.0.2:29500", "--node_rank", "0", "train.py"],
     r"--master '10.0.0.2:29500' conflicts with --ips.*first host"),
    (["--ips", "10.0.0.1,10.0.0.1", "train.py"], r"--ips '10.0.0.1,10.0.0.1' lists a host more than once"),
    (["--ips", "10.0.0.1,bad host", "train.py"], r"--ips '10.0.0.1,bad host' has an invalid host 'bad host'"),
    # Every address in 127.0.0.0/8 is this host: which entry is ambiguous.
    (["--ips", "127.0.0.1,127.0.0.2", "train.py"], r"cannot tell which entry is this host.*Pass --node_rank"),
    (["--ips", "192.0.2.250,198.51.100.7", "train.py"], r"cannot tell which entry is this host.*none matched"),
    (["--log_dir", "train.py", "train.py"], r"--log_dir 'train.py'.*is not a directory"),
    (["--log_dir", "", "train.py"], r"--log_dir '' is not a valid directory path"),
    (["--nproc", "2", "train.py"], r"unrecognized option '--nproc'.*Did you mean '--nproc_per_node'\?"),
    # Far more workers than this host's CPUs: refused before any file or process exists.
    (["--nproc_per_node", "100000", "train.py"],
     r"--nproc_per_node 100000 is more than 4 workers per CPU: this host has \d+ CPU\(s\).*--allow_oversubscribe"),
    (["--nproc_per_node", "2", "bad_syntax.py"],
     r"training script 'bad_syntax.py' has a syntax error \(bad_syntax.py, line 3: 'def f\(:'\)"),
    (["-m", "pkg.bad_syntax"],
     r"-m 'pkg.bad_syntax' has a syntax error \(.*pkg/bad_syntax.py, line 3: 'def f\(:'\)"),
    (["-m", "pkg"], r"-m 'pkg' has a syntax error \(.*pkg/__main__.py, line 3"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT, ids=[" ".join(a) or "<empty>" for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_message(argv, message, script, capsys, monkeypatch):
    # Should validation ever let one through, fail here instead of starting
    # (say) 100000 workers inside the test process.
    monkeypatch.setattr("distamp.launcher.run.launch", lambda plan: pytest.fail(f"launched {plan}"))
    code, err = run_main(argv, capsys)
    assert code == 2
    assert err.startswith("distrun: error: ")
    assert "Traceback" not in err


    assert re.search(message, err, re.DOTALL), err
    # Nothing started: no log directory was created.
    assert not os.path.exists("log")


def fake_gpus(count):
    return lambda: count


def parse(argv, environ=None, gpus=0, cpus=None):
    parser = build_parser()
    own, command = _split_argv(parser, argv)
    args = parser.parse_args(own)
    args.script, args.script_args = (command[0], command[1:]) if command else (None, [])
    if cpus is None:
        return build_plan(args, environ or {}, fake_gpus(gpus))
    return build_plan(args, environ or {}, fake_gpus(gpus), cpu_count=lambda: cpus)


def test_workers_per_cpu_limit_and_the_flag_that_lifts_it(script):
    assert parse(["--nproc_per_node", "8", "train.py"], cpus=2).nproc_per_node == 8
    with pytest.raises(UsageError, match=(
        r"^--nproc_per_node 9 is more than 4 workers per CPU: this host has 2 CPU\(s\), so at most "
        r"8 workers start without --allow_oversubscribe. Use --nproc_per_node 2 \(one per CPU\), "
        r"or add --allow_oversubscribe if you really want 9 processes here.$"
    )):
        parse(["--nproc_per_node", "9", "train.py"], cpus=2)
    plan = parse(["--allow_oversubscribe", "--nproc_per_node", "100000", "train.py"], cpus=2)
    assert plan.nproc_per_node == 100000
    with pytest.raises(UsageError, match=r"--nproc_per_node 65 .* this host has 16 CPU"):
        parse(["--nproc_per_node", "65", "train.py"], cpus=16)
    # --gpus starts one worker per distinct visible GPU: never more than the GPUs.
    assert parse(["--gpus", "0,1,2", "train.py"], gpus=3, cpus=0).nproc_per_node == 3


def test_syntax_check_does_not_run_the_code(script, tmp_path):
    (tmp_path / "side_effect.py").write_text("open('ran', 'w').close()\n")
    (tmp_path / "pkg" / "fine.py").write_text("x = 1\n")
    assert parse(["side_effect.py"]).command == ("side_effect.py",)
    assert parse(["-m", "pkg.fine"]).command == ("-m", "pkg.fine")
    assert not (tmp_path / "ran").exists()


def test_gpus_not_visible_names_the_id(script):
    with pytest.raises(
        UsageError, match=r"--gpus '0,3': GPU 3 is not visible; this process sees 2 GPU\(s\), ids 0 to 1"
    ):
        parse(["--gpus", "0,3", "train.py"], gpus=2)
    with pytest.raises(UsageError, match=r"CUDA_VISIBLE_DEVICES='4,5'"):
        parse(["--gpus", "2", "train.py"], {"CUDA_VISIBLE_DEVICES": "4,5"}, gpus=2)


def test_gpus_map_through_cuda_visible_devices(script):
    plan = parse(["--gpus", "2,0", "train.py"], {"CUDA_VISIBLE_DEVICES": "4,5,6"}, gpus=3)
    assert plan.gpus == ("6", "4")
    assert plan.nproc_per_node == 2
    plan = parse(["--gpus", "1,0", "--nproc_per_node", "2", "train.py"], gpus=2)
    assert plan.gpus == ("1", "0")


def test_valid_plans(script):
    plan = parse(["--nproc_per_node", "3", "--tee", "all", "train.py", "--lr", "0.1", "--nproc_per_node", "9"])
    assert plan.command == ("train.py", "--lr", "0.1", "--nproc_per_node", "9")
    assert (plan.nproc_per_node, plan.world_size, plan.tee) == (3, 3, None)
    assert plan.local_rendezvous
    assert plan.gpus is None
    assert plan.log_dir == "log"
    plan = parse(["--nnodes", "2", "--node_rank", "1", "--master", "[::1]:29501", "train.py"])
    assert (plan.master_addr, plan.master_port, plan.node_rank, plan.world_size) == ("::1", 29501, 1, None)
    plan = parse(["--ips", "127.0.0.1,192.0.2.250", "--nproc_per_node", "2", "--tee", "none", "train.py"])
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port) == (2, 0, "127.0.0.1", 29500)
    assert plan.tee == frozenset()
    plan = parse(["-m", "json.tool", "x"])
    assert plan.command == ("-m", "json.tool", "x")


def test_dashed_spellings_as_torchrun_accepts_them(script):
    grace = 5 if grace_period_supported() else 30  # torch 2.11 refuses any other than its fixed 30 s
    dashed = parse([
        "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:29501",
        "--log-dir", "logs", "--max-restarts", "3", f"--grace-period={grace}", "--allow-oversubscribe",
        "train.py", "--node-rank", "7",
    ])
    underscored = parse([
        "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master", "127.0.0.1:29501",
        "--log_dir", "logs", "--max_restarts", "3", f"--grace_period={grace}", "--allow_oversubscribe",
        "train.py", "--node-rank", "7",
    ])
    assert dashed == underscored
    assert (dashed.nproc_per_node, dashed.node_rank, dashed.log_dir, dashed.max_restarts, dashed.grace_period) == (
        2, 1, "logs", 3, grace
    )
    assert dashed.command == ("train.py", "--node-rank", "7")


@pytest.mark.parametrize(("argv", "command"), [
    (["train.py", "--", "--lr", "1"], ("train.py", "--", "--lr", "1")),
    (["--", "train.py", "--"], ("train.py", "--")),
    (["--nproc_per_node=2", "train.py", "--nproc_per_node", "5", "-m", "x"],
     ("train.py", "--nproc_per_node", "5", "-m", "x")),
    (["--tee", "all", "-m", "json.tool", "--", "-x"], ("-m", "json.tool", "--", "-x")),
])
def test_script_arguments_are_untouched(argv, command, script):
    assert parse(argv).command == command


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for group in ("workers on this node", "several nodes", "logs and failures", "what to run"):
        assert group in out
    assert "--allow_oversubscribe" in out
    assert "4 per CPU" in out


def test_parse_plan_never_starts_anything(script):
    plan = parse_plan(["--nproc_per_node", "2", "train.py"])
    assert plan.nproc_per_node == 2
    assert not os.path.exists("log")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["console", "module"])
def test_shell_sees_exit_code_2(launcher, tmp_path):
    if launcher == "console":
        exe = shutil.which("distrun", path=os.path.dirname(sys.executable))
        assert exe, "pip install -e . provides the distrun console script"
        cmd = [exe]
    else:
        cmd = [sys.executable, "-m", "distamp.launcher"]
    proc = subprocess.run(
        [*cmd, "--nproc_per_node", "2", "nope.py"], check=False, cwd=tmp_path, capture_output=True,
        text=True, timeout=50,
    )
    assert proc.returncode == 2
    assert "training script 'nope.py' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
