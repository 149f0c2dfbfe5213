"""The reference backend: plain PyTorch (kernels/reference.py) on any device and dtype.

It sums every gradient in one fixed order of its own, whatever the schedule, so it needs no plan
tables: it is the CPU path and the oracle the other backends are tested against.
"""
from . import reference
from .backends import DeviceProps


class ReferenceBackend:
    name = "reference"

    def supports(self, request) -> bool:
        return True

    def tiles(self, request):
        return None

    def device_props(self, device) -> DeviceProps:
        return DeviceProps(resident_programs=1, concurrent=False)

    def forward(self, q, k, v, **kw):
        return reference.attention_forward(q, k, v, **kw)

    def backward(self, plan, dout, q, k, v, out, lse, **kw):
        return reference.attention_backward(dout, q, k, v, out, lse, **kw)


BACKEND = ReferenceBackend()
