"""Will a recipe fit its GPUs? Memory per device (each target rank, the draft), from the recipe and the models'
config.json only (no weights read), and the recipe changes that would make it fit.

``configs`` reads the configs, ``shards`` counts each tensor-parallel rank's parameters, ``formats`` gives the
bytes per element each backend holds, ``memory`` sums a device, ``host`` the build host, ``fit`` compares with the
GPUs, ``advice`` plans the changes, ``report`` prints; ``cli`` is ``python -m ssd_trt.build RECIPE --plan``
(and ``python -m ssd_trt.sizing RECIPE...``).
"""
