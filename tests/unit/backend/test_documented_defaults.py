"""Every default is defined once (BackendConfig's fields); config.pbtxt and the README's table agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.config import PARAMETERS, default_value
from tests.helpers import pbtxt_parameters

ROOT = Path(__file__).resolve().parents[3]
EMPTY = "(empty)"  # how the README shows a parameter whose default is the empty string


def readme_defaults() -> dict[str, str]:
    """name -> default cell of the README's configuration table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Za-z_]+)` \| ([^|]*) \|", section, flags=re.MULTILINE)
    assert rows, "no configuration table in the README"
    return {name: cell.strip() for name, cell in rows}


def means_the_default(name: str, raw: str) -> bool:
    if raw == "":
        return default_value(name) in ("", None, ())
    return PARAMETERS[name][1](raw) == default_value(name)


@pytest.mark.parametrize("model", ["lookahead", "baseline"])
def test_every_config_pbtxt_parameter_exists_and_holds_its_default(model: str) -> None:
    parameters = pbtxt_parameters(model)
    assert set(parameters) <= set(PARAMETERS)
    for name, raw in parameters.items():
        if model == "baseline" and name == "use_lookahead":
            assert raw == "false"  # the baseline's one difference
            continue
        assert means_the_default(name, raw), f"{model}/config.pbtxt sets {name}={raw!r}, not its default"


def test_the_lookahead_config_pbtxt_lists_every_parameter() -> None:
    assert set(pbtxt_parameters("lookahead")) == set(PARAMETERS)


def test_the_readme_table_lists_every_parameter_with_its_default() -> None:
    documented = readme_defaults()
    assert set(documented) == set(PARAMETERS)
    shipped = pbtxt_parameters("lookahead")
    for name, cell in documented.items():
        raw = "" if cell == EMPTY else cell.strip("`")
        assert cell == EMPTY or (cell.startswith("`") and cell.endswith("`")), f"{name}: {cell!r}"
        assert raw == shipped[name], f"README says {name} = {cell}, config.pbtxt {shipped[name]!r}"
        assert means_the_default(name, raw), f"README's default of {name} ({cell}) is not BackendConfig's"
