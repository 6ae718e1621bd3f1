"""Serving or generating straight from model files: ``ssd-trt serve target.gguf --draft draft.gguf``.

The steps, one module each: the files checked and read (``models.py``: there, a GGUF's magic, metadata and block
types), the pair's tokenizers compared (``tokenizers.py``), the recipe written from what the files say and the flags
(``recipe.py``), and built once into a cache keyed by the files' sha256 (``cache.py``); ``cli.py`` is the command
line of ``ssd-trt serve`` and ``ssd-trt generate`` over them. Everything after the recipe is the project's own build,
server and generator.
"""
