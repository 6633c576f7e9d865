"""Backend "cpu" (work in progress)."""

from ...dispatch.registry import Backend, register_backend


class _Pending(Backend):
    name = "cpu"
    priorities = {"cpu": 20}

    def available(self):
        return False, "the native cpu module is not implemented in this build yet"


register_backend(_Pending())
