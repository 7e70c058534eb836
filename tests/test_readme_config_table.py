"""The README's config tables and the config dataclasses must agree: same keys, same defaults.

AmpConfig, ShardingConfig and PowerSGDConfig are the one source of truth for their defaults
(house rule 2); this test keeps the documentation from drifting away from them.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest

from distamp.strategy import AmpConfig, PowerSGDConfig, ShardingConfig

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = ["key", "type, range", "default", "meaning"]
_BINARY = {ast.Pow: operator.pow, ast.Mult: operator.mul, ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Div: operator.truediv}


def _safe_eval(text: str):
    """Evaluate a default cell: numbers, ``2**24``, True/False/None, quoted strings, lists."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (left, right)):
                raise ValueError(f"arithmetic on non-numbers in {text!r}")
            if isinstance(node.op, ast.Pow) and abs(right) > 1024:
                raise ValueError(f"exponent too large in {text!r}")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"unsupported default {text!r} (node {type(node).__name__})")

    return value(ast.parse(text.strip(), mode="eval").body)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _unquote_code(cell: str) -> str:
    return cell.replace("`", "").strip()


def parse_amp_configs_table(markdown: str) -> dict:
    """``{key: default}`` from the first key/type/default/meaning table under an amp_configs heading."""
    return parse_config_table(markdown, "amp_configs")


def parse_config_table(markdown: str, name: str) -> dict:
    """``{key: default}`` from the first key/type/default/meaning table under a heading naming ``name``."""
    lines = markdown.splitlines()
    headings = [i for i, line in enumerate(lines) if line.lstrip().startswith("#") and name in line]
    if not headings:
        raise AssertionError(f"no Markdown heading containing {name!r}")
    start = headings[0] + 1
    header = next(
        (i for i in range(start, len(lines))
         if lines[i].lstrip().startswith("|") and [c.lower() for c in _cells(lines[i])] == HEADER),
        None,
    )
    if header is None:
        raise AssertionError(f"no table with header | {' | '.join(HEADER)} | after the {name} heading")
    defaults: dict = {}
    for line in lines[header + 2:]:  # skip the | --- | separator
        if not line.lstrip().startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(HEADER):
            raise AssertionError(f"table row does not have {len(HEADER)} cells: {line!r}")
        keys = [_unquote_code(k) for k in cells[0].split("/")]
        values = [cells[2]] if len(keys) == 1 else cells[2].split(" / ")
        if len(values) != len(keys):
            raise AssertionError(f"row names {len(keys)} keys but {len(values)} defaults: {line!r}")
        for key, raw in zip(keys, values, strict=True):
            if key in defaults:
                raise AssertionError(f"key {key!r} appears twice in the table")
            try:
                defaults[key] = _safe_eval(_unquote_code(raw))
            except (SyntaxError, ValueError) as error:
                raise AssertionError(
                    f"cannot read the default {raw!r} of {key!r}: write a Python literal "
                    f"(number, 2**24, True/False/None, [], 'quoted string'): {error}"
                ) from error
    return defaults


def test_parser_reads_the_design_table_format():
    sample = """
## The `amp_configs` table

| key | type, range | default | meaning |
| --- | --- | --- | --- |
| init_loss_scaling | float > 0 | 32768.0 | first loss scale |
| `use_pure_fp16` | bool | False | "O2" |
| custom_white_list | list of op names | [] | ops forced to low precision |
| dtype | "float16" or "bfloat16" | "float16" | the low-precision type |
| comm_dtype | str or None | `None` | wire dtype |
| min_loss_scaling / max_loss_scaling | float | 1.0 / 2**24 | bounds of the dynamic scale |

After the table.
"""
    assert parse_amp_configs_table(sample) == {
        "init_loss_scaling": 32768.0,
        "use_pure_fp16": False,
        "custom_white_list": [],
        "dtype": "float16",
        "comm_dtype": None,
        "min_loss_scaling": 1.0,
        "max_loss_scaling": 16777216,
    }
    with pytest.raises(ValueError, match="unsupported default"):
        _safe_eval("__import__('os')")
    with pytest.raises(AssertionError, match="cannot read the default 'None \\(same as dtype\\)' of 'comm_dtype'"):
        parse_amp_configs_table(sample.replace("| `None` |", "| None (same as dtype) |"))
    with pytest.raises(AssertionError, match="no table"):
        parse_amp_configs_table("# amp_configs\n\nno table here\n")


@pytest.mark.parametrize(("name", "config"), [("amp_configs", AmpConfig), ("sharding_configs", ShardingConfig),
                                              ("powersgd_configs", PowerSGDConfig)])
def test_readme_config_table_matches_the_dataclass(name, config):
    assert README.is_file(), f"{README} is missing; it must document {name} in a table"
    documented = parse_config_table(README.read_text(encoding="utf-8"), name)
    actual = config().to_dict()
    assert set(documented) == set(actual), (
        f"README lacks {sorted(set(actual) - set(documented))}, "
        f"documents unknown {sorted(set(documented) - set(actual))}"
    )
    wrong = {k: (documented[k], actual[k]) for k in actual
             if documented[k] != actual[k] or (type(documented[k]) is bool) != (type(actual[k]) is bool)}
    assert not wrong, f"README default differs from {config.__name__} (README, {config.__name__}): {wrong}"
