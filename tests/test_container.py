"""The GPU container's default command names only code that exists (it cannot be run here: no Docker engine)."""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_container_default_command_imports_and_scripts_exist():
    dockerfile = (ROOT / "build" / "container" / "Dockerfile").read_text()
    command = " ".join(part for line in dockerfile.splitlines() if line.startswith("CMD")
                       for part in json.loads(line.removeprefix("CMD").strip()))
    imports = re.findall(r"from ([\w.]+) import (\w+)", command)
    scripts = re.findall(r"python3 ([\w/]+\.py)", command)
    assert imports and scripts, command
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} named by the container's CMD"
    for script in scripts:
        assert (ROOT / script).is_file(), f"{script} named by the container's CMD"
