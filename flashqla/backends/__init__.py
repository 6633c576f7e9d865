"""Built-in backends.  Importing this package registers them; heavy frameworks load lazily."""

from ..dispatch.registry import register_backend
from .reference import ReferenceBackend

register_backend(ReferenceBackend())

# Each optional backend registers itself from its own package; a failure to import one must not
# break the others (its availability check reports the reason instead).
from . import cpu  # noqa: E402,F401
from . import triton  # noqa: E402,F401
from . import tilelang  # noqa: E402,F401
from . import cutlass  # noqa: E402,F401
