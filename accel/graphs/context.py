"""``accel.graph(g)``: capture the body into a Graph on a side stream (``torch.cuda.graph``).

Every argument is checked before anything is synchronized, emptied or created; the block then
starts as ``with g:`` does (:mod:`.block`) on the given stream or one kept per device (the side
streams, forgotten when the runtime is reset), which first waits for the current stream.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

from .. import _lazy
from ..memory._mempool import check_pool_id as _check_pool
from ..streams import Stream, _as_stream, current_stream
from .block import _end_after_error, _end_block, _refuse_then_synchronize
from .checks import _check_mode
from .graph_class import Graph


@contextlib.contextmanager
def graph(cuda_graph: Graph, pool: Optional[Tuple[int, int]] = None, stream: Optional[Stream] = None,
          capture_error_mode: str = "global", enable_annotations: bool = False,
          check_input_liveness: bool = False):
    """Capture the body into ``cuda_graph`` on a side stream (``torch.cuda.graph``).

    The side stream (``stream``, or one kept per device) first waits for the
    current stream, so the captured work sees everything queued before.

    ``enable_annotations`` and ``check_input_liveness`` are torch 2.13's keywords; accel has
    neither kernel annotations nor input tracking, so only ``False`` (the default) is taken:
    ``True`` raises NotImplementedError before anything happens.
    """
    # Every argument is checked before anything is synchronized, emptied or created.
    if not isinstance(cuda_graph, Graph):
        raise TypeError(f"graph() expects an accel.Graph, got {type(cuda_graph).__name__}")
    if enable_annotations:
        raise NotImplementedError("graph(enable_annotations=True): accel records no kernel annotations "
                                  "(torch's need cuda.bindings and a 13.1 driver); leave it False")
    if check_input_liveness:
        raise NotImplementedError("graph(check_input_liveness=True): accel does not track a capture's input "
                                  "Buffers; keep every Buffer the graph reads alive (and open) while it is "
                                  "replayed, and leave check_input_liveness False")
    mode = _check_mode(capture_error_mode)
    if pool is not None:
        _check_pool(pool)
    if stream is not None:
        stream = _as_stream(stream, "graph(stream)")
        stream._live()                          # a closed stream: refused before the synchronize
    import accel
    # the current device (the one the synchronize waits on), and the capture stream's
    _refuse_then_synchronize(cuda_graph, (None,) if stream is None else (None, stream.device_index), stream)
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()     # torch 2.13 graph.__enter__: torch._C._host_emptyCache()
    capture_stream = stream if stream is not None else _side_stream()
    capture_stream.wait_stream(current_stream(capture_stream.device_index))
    saved = (cuda_graph.graph_pool, cuda_graph.capture_error_mode)
    with capture_stream:
        try:
            # (set inside the try: a Ctrl-C as the stream was entered changes nothing of the graph)
            if pool is not None:
                cuda_graph.graph_pool = pool
            cuda_graph.capture_error_mode = mode
            cuda_graph.capture_begin()
        finally:
            # torch passes pool and mode to this capture_begin only: the graph's own stay as they were
            cuda_graph.graph_pool, cuda_graph.capture_error_mode = saved
        try:
            yield cuda_graph
        except BaseException as exc:
            _end_after_error(cuda_graph, exc)
            raise
        try:
            _end_block(cuda_graph)
        except BaseException as exc:
            # (a KeyboardInterrupt before the capture ended: ended and discarded, as after an error;
            # _end_block_or_discard inlined, as a function's start is one more point it can land)
            if cuda_graph._stream is not None:
                _end_after_error(cuda_graph, exc)
            raise


_side_streams = {}


def _side_stream() -> Stream:
    index = _lazy.lazy_init().get_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = Stream(index)
    return stream


_lazy.register_reset_hook(_side_streams.clear)
