"""Fuzz the ``distrun`` command line: valid input parses, bad input is a UsageError.

``parse_plan`` validates without starting anything, so any argv is safe to
try. The only outcomes allowed are a plan or a :class:`UsageError` whose
message names a flag, the script, or the offending value; ``main()`` turns
the latter into exit code 2.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distamp.launcher.cli import main, parse_plan
from distamp.launcher.plan import LaunchPlan, UsageError

FLAGS = [
    "--gpus", "--nproc_per_node", "--nnodes", "--node_rank", "--master", "--ips",
    "--log_dir", "--tee", "--max_restarts", "--grace_period",
]
VALUES = st.one_of(
    st.integers(-3, 70000).map(str),
    st.sampled_from(["0,1", "0,0", "all", "none", "127.0.0.1:29500", "h:0", "[::1]:1", "a,b",
                     "10.0.0.1,10.0.0.2", "", " ", "-1", "1.5", "log", "train.py", "x:y:z"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12),
)
ARGV = st.builds(
    lambda words, tail: words + tail,
    st.lists(st.one_of(st.sampled_from([*FLAGS, "-m", "--bogus", "train.py"]), VALUES), max_size=8),
    st.sampled_from([["train.py"], ["train.py", "--lr", "1"], []]),
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=ARGV)
def test_any_argv_is_a_plan_or_a_usage_error(argv, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.getbasetemp())
    (tmp_path_factory.getbasetemp() / "train.py").write_text("")
    try:
        plan = parse_plan(argv)
    except UsageError as exc:
        message = str(exc)
        assert message
        assert "Traceback" not in message
        named = [a for a in argv if a and a in message] + ["script", "option", "argument", "-m"]
        assert any(n in message for n in named), (argv, message)
        return
    assert isinstance(plan, LaunchPlan)
    assert plan.nproc_per_node >= 1
    assert 0 <= plan.node_rank < plan.nnodes
    if plan.tee is not None and plan.world_size is not None:
        assert plan.tee <= frozenset(range(plan.world_size))


def test_main_returns_2_for_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--nnodes", "\x01"]) == 2
    assert "--nnodes" in capsys.readouterr().err
