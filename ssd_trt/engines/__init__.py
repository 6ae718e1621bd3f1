"""Engines run one model's step graph behind one interface (see :mod:`ssd_trt.engines.base`)."""
