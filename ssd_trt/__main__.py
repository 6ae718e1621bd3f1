"""``python -m ssd_trt COMMAND ...``: the ``ssd-trt`` command (``ssd_trt/cli.py``)."""
import sys

from ssd_trt.cli import main

if __name__ == "__main__":
    sys.exit(main())
