"""``python -m ssd_trt.sizing RECIPE... `` (and ``python -m ssd_trt.build RECIPE --plan``): will it fit?

Reads each recipe and its models' config.json (no weights), prints a table per recipe of every GPU's memory
(target rank r on GPU r, the draft on GPU N), the verdict and, when it does not fit, the recipe changes that
would, each planned again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ssd_trt.arguments import ArgumentParser
from ssd_trt.errors import SsdTrtError

EPILOG = ("exit status: 0 when every GPU of every recipe fits, 1 when one does not, 2 for a bad recipe or "
          "config.json (or a tensor_parallel that does not split the target)")
CONFIGS_HELP = ("a folder of config.json files for models not downloaded yet: a source /models/NAME is sized from "
                "DIR/NAME/config.json when it exists (e.g. --configs tests/data/configs)")
DEFAULT_GPU_MEMORY_GIB = 80.0
GPU_MEMORY_HELP = f"memory of each GPU in GiB (default {DEFAULT_GPU_MEMORY_GIB:g}; a tenth is kept free)"


def run(recipes: list[Path], gpu_memory_gib: float | None = None, configs_dir: Path | None = None,
        as_json: bool = False, tensor_parallel: int | None = None) -> int:
    """Plan each recipe (at ``tensor_parallel`` ranks instead of its own when given), print the tables (or one JSON
    object ``{"plans": [...]}``); the exit status."""
    from pydantic import ValidationError

    from ssd_trt.recipe import load_recipe
    from ssd_trt.sizing.advice import suggestions
    from ssd_trt.sizing.configs import model_configs
    from ssd_trt.sizing.fit import plan_fit, with_engine
    from ssd_trt.sizing.report import plan_json, render

    gpu_memory_gib = DEFAULT_GPU_MEMORY_GIB if gpu_memory_gib is None else gpu_memory_gib

    if not gpu_memory_gib > 0:
        print(f"ssd_trt.sizing: error: --gpu-memory must be positive, got {gpu_memory_gib}", file=sys.stderr)
        return 2
    plans = []
    try:
        for path in recipes:
            recipe = load_recipe(path)
            if tensor_parallel is not None:
                recipe = with_engine(recipe, tensor_parallel=tensor_parallel)
            plan = plan_fit(recipe, model_configs(recipe, Path(path), configs_dir), int(gpu_memory_gib * (1 << 30)))
            plans.append(plan_json(plan, suggestions(plan)))
    except SsdTrtError as error:
        print(f"ssd_trt.sizing: error: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:      # --tensor-parallel out of the recipe's range
        print(f"ssd_trt.sizing: error: --tensor-parallel {tensor_parallel}: {error.errors()[0]['msg']}",
              file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"plans": plans}, indent=1))
    else:
        print("\n\n".join(render(plan) for plan in plans))
    return 0 if all(plan["fits"] for plan in plans) else 1


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ssd_trt.sizing", description=__doc__.splitlines()[0], epilog=EPILOG)
    parser.add_argument("recipes", type=Path, nargs="+", help="recipe YAML files, e.g. recipes/gpu/*.yaml")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help=GPU_MEMORY_HELP)
    parser.add_argument("--configs", type=Path, metavar="DIR", help=CONFIGS_HELP)
    parser.add_argument("--json", action="store_true", help="print the plans as JSON (bytes) instead of tables")
    parser.add_argument("--tensor-parallel", type=int, metavar="N",
                        help="plan as if each recipe set engine.tensor_parallel: N (what would N ranks need?)")
    args = parser.parse_args(argv)
    return run(args.recipes, args.gpu_memory, args.configs, args.json, args.tensor_parallel)
