"""Backend "triton" (work in progress: registered so that dispatch and explain() know of it)."""

from ...dispatch.registry import Backend, register_backend


class _Pending(Backend):
    name = "triton"
    priorities = {"sm_80+": 10}

    def available(self):
        return False, "the triton kernels are not implemented in this build yet"


register_backend(_Pending())
