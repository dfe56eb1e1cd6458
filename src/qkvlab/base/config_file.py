"""Config files: the one reader of YAML, TOML and JSON settings files (and of any text file a user
names) and the printer behind --print-config. Torch-free: the bottom floor, under qkvlab.base.settings
(which merges a file with the command line)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from qkvlab.base.errors import UserError
from qkvlab.base.files import read_user_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli is the same parser
    import tomli as tomllib


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML (.yaml/.yml), TOML (.toml) or JSON file -> mapping; parse errors are one line."""
    path = Path(path)
    text = read_user_text(path, f"{path} (config file)")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise UserError(f"{path}: config files must be .yaml, .yml, .toml or .json")
    except UserError:
        raise
    except Exception as e:  # yaml/toml/json each raise their own types; the user needs one line
        first = " ".join(str(e).split())
        raise UserError(f"{path}: cannot parse ({first})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of settings at the top level")
    return data


def config_to_text(body: Mapping[str, Any], fmt: str = "yaml") -> str:
    """A resolved config as YAML (default) or JSON, for --print-config."""
    if fmt == "json":
        return json.dumps(body, indent=2)
    return yaml.safe_dump(json.loads(json.dumps(body)), sort_keys=False).rstrip()
