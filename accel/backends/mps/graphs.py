"""Graphs: refused, because Metal has no stream capture.

Work submitted to a command queue cannot be recorded for replay, so ``supports_graphs`` is
False and ``Backend``'s capture and graph methods raise ``NotImplementedError`` with
:attr:`GraphsMixin.no_capture_reason`.
"""

_GRAPHS_UNSUPPORTED = (
    "MPS has no stream capture: Metal cannot record the work submitted to a command queue "
    "for later replay, so accel graphs (capture_begin/capture_end/replay) are not available "
    "on the mps backend; run the work eagerly instead")


class GraphsMixin:
    """No graphs: the protocol's capture and graph methods refuse with this reason."""

    no_capture_reason = _GRAPHS_UNSUPPORTED
