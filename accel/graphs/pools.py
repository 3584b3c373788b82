"""The ids of the graphs' memory pools.

A pool id is torch's ``MempoolId_t`` pair: :func:`generate_graph_pool_handle` (torch.cuda's
``graph_pool_handle``) gives ``(0, n)`` from the counter :class:`accel.MemPool` ids share, for
graphs that share one pool (``Graph(pool=...)``); a graph given none makes its own private
pool ``(n, 0)`` at capture_begin, from this module's counter.
"""

from __future__ import annotations

import itertools
from typing import Tuple

from .. import _locks

# torch's MempoolId_t (c10/cuda MemPool::graph_pool_handle): ids a user asks for are
# {0, n} (graph_pool_handle and MemPool share accel.memory._mempool's counter), the pool a
# graph makes for itself {n, 0}, each from its own counter.
_graph_pool_ids = itertools.count(1)
_pool_lock = _locks.Lock("a graph's private pool id")


def generate_graph_pool_handle() -> Tuple[int, int]:
    """A fresh pool id ``(0, n)`` to pass as ``Graph(pool=...)`` so several graphs share
    one memory pool (a graph's own pool is ``(n, 0)``, as torch's MempoolId_t).  A
    :class:`accel.MemPool`'s ``id`` comes from the same counter."""
    from ..memory import _mempool
    return _mempool.new_user_pool_id()


graph_pool_handle = generate_graph_pool_handle  # torch.cuda's name


def _new_private_pool() -> Tuple[int, int]:
    with _pool_lock:
        return (next(_graph_pool_ids), 0)
