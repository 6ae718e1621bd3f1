import sys

from ssd_trt.sizing.cli import main

if __name__ == "__main__":
    sys.exit(main())
