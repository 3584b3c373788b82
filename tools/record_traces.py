#!/usr/bin/env python3
"""Record allocation traces from real PyTorch workloads (torch is an oracle, never a dependency).

    pip install torch==2.13.0                       # the CPU wheel
    python tools/record_traces.py                   # every workload into tests/test_memory_traces/
    python tools/record_traces.py --list
    python tools/record_traces.py kv_cache_decode --out /tmp/traces
    python tools/record_traces.py --holdout         # the held-out set (tools/holdout_workloads.py)

Each workload runs a few deterministic training or inference steps (seeded, one
intra-op thread) under ``torch.profiler.profile(profile_memory=True)``, the way
the shared traces in ``../shared/traces`` were made.  The profiler's allocation
events (the CPU allocator's only: other devices are dropped) are put in time
order and paired by address: an event of positive size at address ``p`` opens
block ``id``, the next negative event at ``p`` frees it.  A free of an address
allocated before recording started is dropped; a block still live when
recording stops stays unfreed.  The trace format is the shared one::

    {"name", "source", "ops": [["a", id, nbytes] | ["f", id], ...]}

The pairing is :func:`pair_events` (no torch needed; tests/test_memory_traces_corpus.py
checks it on a synthetic event list).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tests", "test_memory_traces")
HOLDOUT_OUT = os.path.join(DEFAULT_OUT, "holdout")
TORCH_VERSION = "2.13"

#: (time_ns, ptr, signed nbytes, device) as the profiler reports an allocation event
Event = Tuple[int, int, int, str]


def pair_events(events: Iterable[Event]) -> Tuple[List[list], Dict[str, int]]:
    """Turn profiler allocation events into trace ops, paired by address.

    ``events`` are ``(time_ns, ptr, nbytes, device)``; ``nbytes > 0`` allocates,
    ``nbytes < 0`` frees.  They are ordered by time (stable: equal times keep
    their given order).  Events whose device is not ``"cpu"`` are dropped (not
    the CPU allocator's), as are zero-size events and frees of addresses not
    allocated while recording.  An allocation at an address that is still live
    (its free was not reported) first frees the stale block, so no two live
    blocks share an address.  Returns ``(ops, counts)`` where ``counts`` says
    how many events each rule dropped or repaired.
    """
    counts = {"allocs": 0, "frees": 0, "other_device": 0, "zero_size": 0,
              "unknown_free": 0, "stale_live": 0, "size_mismatch": 0}
    live: Dict[int, Tuple[int, int]] = {}      # ptr -> (block id, nbytes)
    ops: List[list] = []
    next_id = 0
    for _, ptr, nbytes, device in sorted(events, key=lambda e: e[0]):
        if str(device).lower() != "cpu":
            counts["other_device"] += 1
            continue
        if nbytes == 0:
            counts["zero_size"] += 1
            continue
        if nbytes > 0:
            if ptr in live:
                counts["stale_live"] += 1
                ops.append(["f", live.pop(ptr)[0]])
            live[ptr] = (next_id, nbytes)
            ops.append(["a", next_id, nbytes])
            next_id += 1
            counts["allocs"] += 1
        else:
            block = live.pop(ptr, None)
            if block is None:
                counts["unknown_free"] += 1
                continue
            if block[1] != -nbytes:
                counts["size_mismatch"] += 1
            ops.append(["f", block[0]])
            counts["frees"] += 1
    return ops, counts


def dump_trace(trace: dict, path: str) -> None:
    """Write a trace with one op per line (readable diffs, ~16 bytes an op)."""
    head = json.dumps({k: v for k, v in trace.items() if k != "ops"})[:-1]
    with open(path, "w") as fh:
        fh.write(head + ', "ops": [\n')
        fh.write(",\n".join(json.dumps(op, separators=(",", ":")) for op in trace["ops"]))
        fh.write("\n]}\n")


# --------------------------------------------------------------------------- recording

def _profiler_events(prof) -> List[Event]:
    from torch._C._profiler import _EventType

    out: List[Event] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            out.append((node.start_time_ns, int(f.ptr), int(f.alloc_size), str(f.device)))
    # the walk above is depth-first, not chronological; ties keep address order (stable)
    out.sort(key=lambda e: e[0])
    return out


def record(name: str, source: str, setup: Callable, run: Callable) -> dict:
    """Seed, build the workload (``setup()``, not recorded), record ``run(state)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(1)          # intra-op workers allocate in racy order otherwise
    state = setup()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(state)
    ops, counts = pair_events(_profiler_events(prof))
    return {"name": name, "source": f"torch {TORCH_VERSION} CPU profiler memory events; {source}",
            "ops": ops, "_counts": counts}


# --------------------------------------------------------------------------- workloads

def _cnn_varbatch_train():
    import torch
    from torch import nn

    def block(i, o, stride):
        return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                             nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

    def setup():
        model = nn.Sequential(block(3, 32, 1), block(32, 64, 2), block(64, 128, 2),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def run(state):
        model, opt = state
        for batch in (16, 48, 8, 32):
            x, y = torch.randn(batch, 3, 48, 48), torch.randint(0, 10, (batch,))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return setup, run, "3-stage conv net with batchnorm, SGD momentum, batches 16/48/8/32 of 3x48x48"


def _lstm_varseq_train():
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4000, 128)
            self.rnn = nn.LSTM(128, 256, num_layers=2, batch_first=True)
            self.out = nn.Linear(256, 4000)

        def forward(self, x):
            return self.out(self.rnn(self.emb(x))[0])

    def setup():
        model = LM()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for seq in (24, 70, 40, 100):
            x = torch.randint(0, 4000, (16, seq + 1))
            opt.zero_grad(set_to_none=True)
            logits = model(x[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 4000), x[:, 1:].reshape(-1)).backward()
            opt.step()
    return setup, run, "2-layer LSTM language model (vocab 4000, hidden 256), Adam, batch 16, seq 24/70/40/100"


def _transformer(torch, nn, d, heads, layers, vocab, ff=4, causal=True):
    """A pre-norm transformer from plain modules (shared by several workloads); ``caches``
    (one dict per block) turns on the KV cache, ``checkpoint`` recomputes each block."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, ff * d), nn.GELU(), nn.Linear(ff * d, d))

        def forward(self, x, cache=None):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if cache is not None:
                if "k" in cache:           # the growing KV cache: a new, longer tensor every step
                    k = torch.cat([cache["k"], k], dim=2)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
            att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal and cache is None)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(1024, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx, caches=None, start=0, checkpoint=False):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(start, start + t))
            for i, blk in enumerate(self.blocks):
                if checkpoint:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
                else:
                    x = blk(x, None if caches is None else caches[i])
            return self.head(self.ln(x))

    return Model()


def _kv_cache_decode():
    import torch
    from torch import nn

    def setup():
        return _transformer(torch, nn, d=512, heads=8, layers=4, vocab=16000).eval()

    def run(model):
        with torch.no_grad():
            for batch, prompt, steps in ((8, 64, 40), (4, 128, 24)):
                caches = [dict() for _ in model.blocks]
                idx = torch.randint(0, 16000, (batch, prompt))
                logits = model(idx, caches)
                pos = prompt
                for _ in range(steps):
                    nxt = logits[:, -1].argmax(-1, keepdim=True)
                    logits = model(nxt, caches, start=pos)
                    pos += 1
                del caches, logits
    return setup, run, ("4-layer d=512 transformer decoder (vocab 16000) inference with a torch.cat-grown KV "
                        "cache: batch 8 prompt 64 + 40 greedy tokens, then batch 4 prompt 128 + 24")


def _unet_eval_varsize():
    import torch
    from torch import nn

    def conv(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU(),
                             nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU())

    class UNet(nn.Module):
        def __init__(self, c=(16, 32, 64, 128)):
            super().__init__()
            self.down = nn.ModuleList([conv(3, c[0])] + [conv(c[i], c[i + 1]) for i in range(3)])
            self.up = nn.ModuleList(nn.ConvTranspose2d(c[i + 1], c[i], 2, 2) for i in range(3))
            self.dec = nn.ModuleList(conv(2 * c[i], c[i]) for i in range(3))
            self.out = nn.Conv2d(c[0], 2, 1)

        def forward(self, x):
            skips = []
            for i, d in enumerate(self.down):
                x = d(x if i == 0 else nn.functional.max_pool2d(x, 2))
                skips.append(x)
            for i in (2, 1, 0):
                x = self.dec[i](torch.cat([self.up[i](x), skips[i]], 1))
            return self.out(x)

    def setup():
        return UNet().eval()

    def run(model):
        with torch.no_grad():
            for size in (96, 160, 64, 128, 192):
                model(torch.randn(2, 3, size, size))
    return setup, run, "4-level U-Net (GroupNorm, SiLU) eval, batch 2, images 96/160/64/128/192"


def _embedding_bag_train():
    import torch
    from torch import nn

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(200_000, 64, mode="sum", sparse=True)
            self.item = nn.Embedding(50_000, 64)
            self.mlp = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1))

        def forward(self, ids, offsets, item):
            return self.mlp(torch.cat([self.bag(ids, offsets), self.item(item)], 1)).squeeze(1)

    def setup():
        model = Rec()
        sparse = torch.optim.SparseAdam([model.bag.weight], lr=1e-3)
        dense = torch.optim.Adam([p for n, p in model.named_parameters() if n != "bag.weight"], lr=1e-3)
        return model, sparse, dense

    def run(state):
        model, sparse, dense = state
        g = torch.Generator().manual_seed(1)
        for batch, per_bag in ((512, 20), (2048, 8), (1024, 40), (256, 60)):
            lengths = torch.randint(1, 2 * per_bag, (batch,), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
            ids = torch.randint(0, 200_000, (int(lengths.sum()),), generator=g)
            item = torch.randint(0, 50_000, (batch,), generator=g)
            sparse.zero_grad(set_to_none=True)
            dense.zero_grad(set_to_none=True)
            loss = nn.functional.binary_cross_entropy_with_logits(
                model(ids, offsets, item), torch.rand(batch, generator=g))
            loss.backward()
            sparse.step()
            dense.step()
    return setup, run, ("recommender: EmbeddingBag 200k x 64 (sparse grads, SparseAdam) + Embedding 50k x 64 "
                        "(dense Adam) + MLP; batches 512/2048/1024/256 of variable-length bags")


def _bert_checkpoint_train():
    import torch
    from torch import nn

    def setup():
        model = _transformer(torch, nn, d=256, heads=4, layers=6, vocab=10000, causal=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run(state):
        model, opt = state
        for batch, seq in ((8, 128), (16, 64), (8, 160)):
            x = torch.randint(0, 10000, (batch, seq))
            opt.zero_grad(set_to_none=True)
            logits = model(x, checkpoint=True)
            nn.functional.cross_entropy(logits.reshape(-1, 10000), x.reshape(-1)).backward()
            opt.step()
    return setup, run, ("6-layer d=256 BERT-like encoder with torch.utils.checkpoint per layer (non-reentrant), "
                        "AdamW, batch x seq 8x128, 16x64, 8x160")


def _gpt_varshape_train():
    import torch
    from torch import nn

    def setup():
        model = _transformer(torch, nn, d=192, heads=6, layers=4, vocab=6000)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    def run(state):
        model, opt = state
        for batch, seq in ((4, 64), (12, 128), (2, 256), (6, 96)):
            x = torch.randint(0, 6000, (batch, seq + 1))
            opt.zero_grad(set_to_none=True)
            logits = model(x[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 6000), x[:, 1:].reshape(-1)).backward()
            opt.step()
    return setup, run, "4-layer d=192 GPT-like decoder training, AdamW, batch x seq 4x64, 12x128, 2x256, 6x96"


def _resnet_eval_varsize():
    import torch
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, i, o, stride):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o)
            self.c2, self.b2 = nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o)
            self.short = (nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o))
                          if stride != 1 or i != o else nn.Identity())

        def forward(self, x):
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.short(x))

    def setup():
        layers = [nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        for i, o, s in ((32, 32, 1), (32, 64, 2), (64, 128, 2), (128, 256, 2)):
            layers += [Basic(i, o, s), Basic(o, o, 1)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000)]
        return nn.Sequential(*layers).eval()

    def run(model):
        with torch.inference_mode():
            for batch, size in ((8, 224), (16, 160), (4, 320), (8, 192)):
                model(torch.randn(batch, 3, size, size))
    return setup, run, "ResNet-18-ish (half width) eval under inference_mode, batch x image 8x224, 16x160, 4x320, 8x192"


def _mlp_tabular_train():
    import torch
    from torch import nn

    def setup():
        model = nn.Sequential(nn.Linear(300, 1024), nn.LayerNorm(1024), nn.ReLU(), nn.Dropout(0.1),
                              nn.Linear(1024, 512), nn.LayerNorm(512), nn.ReLU(), nn.Dropout(0.1),
                              nn.Linear(512, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for batch in (4096, 1000, 7000, 256, 2500):
            x, y = torch.randn(batch, 300), torch.randn(batch)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
    return setup, run, "tabular MLP 300-1024-512-1 with LayerNorm and dropout, Adam, batches 4096/1000/7000/256/2500"


WORKLOADS: Dict[str, Callable] = {
    "cnn_varbatch_train": _cnn_varbatch_train,
    "lstm_varseq_train": _lstm_varseq_train,
    "kv_cache_decode": _kv_cache_decode,
    "unet_eval_varsize": _unet_eval_varsize,
    "embedding_bag_train": _embedding_bag_train,
    "bert_checkpoint_train": _bert_checkpoint_train,
    "gpt_varshape_train": _gpt_varshape_train,
    "resnet_eval_varsize": _resnet_eval_varsize,
    "mlp_tabular_train": _mlp_tabular_train,
}


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", help=f"which to record (default: all of {', '.join(WORKLOADS)})")
    parser.add_argument("--out", help=f"folder for the NAME.json files (default: {DEFAULT_OUT}, "
                                      f"or {HOLDOUT_OUT} with --holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="the held-out workloads of tools/holdout_workloads.py instead of the corpus")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    args = parser.parse_args(argv)
    workloads = WORKLOADS
    if args.holdout:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import holdout_workloads
        workloads = holdout_workloads.WORKLOADS
    out = args.out or (HOLDOUT_OUT if args.holdout else DEFAULT_OUT)
    if args.list:
        for name, make in workloads.items():
            print(f"{name:<24}{make()[2]}")
        return 0
    unknown = [w for w in args.workloads if w not in workloads]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(workloads)}")
    try:
        import torch
    except ImportError:
        parser.error("torch is needed to record (pip install torch==2.13.0); it is not an accel dependency")
    if not torch.__version__.startswith(TORCH_VERSION):
        print(f"warning: torch {torch.__version__}, the corpus was recorded with {TORCH_VERSION}", file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    for name in args.workloads or list(workloads):
        setup, run, source = workloads[name]()
        trace = record(name, source, setup, run)
        counts = trace.pop("_counts")
        path = os.path.join(out, name + ".json")
        dump_trace(trace, path)
        print(f"{name}: {len(trace['ops'])} ops, {os.path.getsize(path) / 1024:.0f} KiB; {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
