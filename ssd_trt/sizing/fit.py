"""Whether a recipe fits its GPUs: every device's memory (``memory.py``) against the GPU's usable memory, and the
host memory its build needs (``host.py``)."""
from __future__ import annotations

from dataclasses import dataclass

from ssd_trt.recipe import Recipe
from ssd_trt.sizing.configs import SizedModel
from ssd_trt.sizing.formats import Formats, engine_formats
from ssd_trt.sizing.host import build_host_memory
from ssd_trt.sizing.memory import DeviceMemory, recipe_devices, usable_bytes


@dataclass(frozen=True)
class FitPlan:
    recipe: Recipe
    models: dict[str, SizedModel]
    formats: dict[str, Formats]
    devices: list[DeviceMemory]
    gpu_memory: int            # bytes per GPU
    host: dict

    @property
    def usable(self) -> int:
        return usable_bytes(self.gpu_memory)

    @property
    def fits(self) -> bool:
        return all(device.total <= self.usable for device in self.devices)

    @property
    def peak(self) -> int:
        """The fullest device's bytes."""
        return max(device.total for device in self.devices)

    def role_fits(self, role: str) -> bool:
        return all(device.total <= self.usable for device in self.devices if device.role == role)


def plan_fit(recipe: Recipe, models: dict[str, SizedModel], gpu_memory: int) -> FitPlan:
    """The recipe's memory plan on GPUs of ``gpu_memory`` bytes (RecipeError: tensor_parallel does not split the
    target)."""
    formats = {role: engine_formats(recipe, role, model.gguf) for role, model in models.items()}
    devices = recipe_devices(recipe, {role: model.config for role, model in models.items()}, formats)
    return FitPlan(recipe, models, formats, devices, gpu_memory, build_host_memory(recipe, models, devices))


def with_engine(recipe: Recipe, **changes) -> Recipe:
    """The recipe with some engine fields changed, validated as a recipe file would be."""
    data = recipe.model_dump()
    data["engine"] = {**data["engine"], **changes}
    return Recipe.model_validate(data)


def with_models(recipe: Recipe, roles: list[str], **changes) -> Recipe:
    """The recipe with the same fields of the ``roles``' models changed (e.g. ``weights="int4"``), validated."""
    data = recipe.model_dump()
    for role in roles:
        data[role] = {**data[role], **changes}
    return Recipe.model_validate(data)
