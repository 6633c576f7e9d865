"""Backend "tilelang" (work in progress: registered so that dispatch and explain() know of it)."""

from ...dispatch.registry import Backend, register_backend


class _Pending(Backend):
    name = "tilelang"
    priorities = {"sm_90": 30}

    def available(self):
        return False, "the tilelang kernels are not implemented in this build yet"


register_backend(_Pending())
