"""``python -m flashqla.backends.cutlass '[kind, key, arch, out]'``: builds one kernel's on-disk library (the
detached child that ``compile_kernel`` starts, so the first call does not wait for it)."""
import sys

from . import _export_main

sys.exit(_export_main(sys.argv[1:]))
