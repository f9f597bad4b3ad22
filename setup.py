"""The one native piece of kvd: ``kvd.core._rowcopy`` (the same-node copy's rows
without the GIL, kvd/core/_rowcopy.c). Everything else is in pyproject.toml.

``optional=True``: where no C compiler is found (a slim image), the install goes
on without it and ``kvd.core.local_copy`` copies with ``ctypes.memmove``, one
row at a time (slower for rows of less than ~1 MiB, docs/PERFORMANCE.md). The
source is absent in the Dockerfile's first stage, which installs only the
dependencies.
"""

import os

from setuptools import Extension, setup

SOURCE = "kvd/core/_rowcopy.c"

setup(ext_modules=[Extension("kvd.core._rowcopy", [SOURCE], extra_compile_args=["-O2"],
                             extra_link_args=["-pthread"], optional=True)]
      if os.path.exists(SOURCE) else [])
