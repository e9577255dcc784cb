"""What the tests share and are not tests themselves: fixtures (tiny
models, configs, datasets, filtered copies), the devices tests run on,
the device-discipline checks, the float64 reference operators, the Triton
case files the Triton tests run in a subprocess, and the writers of the
golden files under ``tests/golden``. One module per concern, named without
a leading underscore (pytest collects only ``test_*.py``)."""
