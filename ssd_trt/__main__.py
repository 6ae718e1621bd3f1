import sys

print("usage: python -m ssd_trt.build RECIPE | python -m ssd_trt.generate BUILD_DIR | "
      "python -m ssd_trt.bench BUILD_DIR", file=sys.stderr)
sys.exit(2)
