"""Building TensorRT engines (build side only; opening and running them is ``ssd_trt.engines``).

Nothing here imports TensorRT at import time (constructing TensorRT objects without a GPU kills the
process): ``engines.availability.probe_tensorrt`` asks in a subprocess, ``engine_build.build_engine``
imports TensorRT only after the probe says yes.
"""
