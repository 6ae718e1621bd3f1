"""ssd-trt's own CPU kernels: a small-M matmul over GGUF blocks as the file stores them (``csrc/``: one file per
instruction set, ``scalar.c`` the specification), compiled here by ``build.py`` and called through ``native.py``."""
