"""Build bnbw_c_example, a C extension module that calls bnbw_native's C API:

    python setup.py build_ext --inplace

The only thing it needs from bnbw_native at build time is the header directory."""
from setuptools import Extension, setup

import bnbw_native

setup(
    name="bnbw_c_example",
    version="0",
    ext_modules=[Extension("bnbw_c_example", ["bnbw_c_example.c"],
                           include_dirs=[bnbw_native.get_include()])],
)
