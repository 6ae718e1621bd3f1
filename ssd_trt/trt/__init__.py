"""TensorRT path: availability probe, optimisation profiles, binding layout, engine build, runtime.

Nothing here imports TensorRT at import time (constructing TensorRT objects without a GPU kills the
process): ``availability.probe_tensorrt`` asks in a subprocess, ``engine_build.build_engine`` and
``engine.TensorRTEngine`` import it only after the probe says yes.
"""
