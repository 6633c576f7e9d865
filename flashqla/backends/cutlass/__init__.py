"""Backend "cutlass" (work in progress: registered so that dispatch and explain() know of it)."""

from ...dispatch.registry import Backend, register_backend


class _Pending(Backend):
    name = "cutlass"
    priorities = {"sm_90": 20}

    def available(self):
        return False, "the cutlass kernels are not implemented in this build yet"


register_backend(_Pending())
