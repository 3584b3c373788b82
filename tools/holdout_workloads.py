"""Held-out allocation workloads: recorded after the allocator policy was tuned on the
corpus (``tools/record_traces.py``), to check that it generalizes.  Kept apart in
``tests/test_memory_traces/holdout/``; ``python tools/replay_trace.py --holdout`` replays them.

    python tools/record_traces.py --holdout            # every one of them
    python tools/record_traces.py --holdout moe_train

They were used once to choose between two piece rules of expandable segments (E9 in
``accel/memory/_expandable.py``) and one classic-segment rule; record a fresh set before
tuning on them again.  Each returns ``(setup, run, description)`` as the corpus workloads do.
"""

from __future__ import annotations

from typing import Callable, Dict


def _vit_train_varbatch():
    import torch
    from torch import nn

    class ViT(nn.Module):
        def __init__(self, d=192, layers=5, patch=8, img=64, classes=100):
            super().__init__()
            self.patch = nn.Conv2d(3, d, patch, patch)
            n = (img // patch) ** 2
            self.cls = nn.Parameter(torch.zeros(1, 1, d))
            self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 6, 4 * d, dropout=0.1, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            return self.head(self.ln(self.enc(x)[:, 0]))

    def setup():
        model = ViT()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    def run(state):
        model, opt = state
        for batch in (8, 24, 16, 32):
            x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 100, (batch,))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return setup, run, ("ViT (8x8 patch conv embed, 5 pre-norm nn.TransformerEncoderLayer d=192, dropout), "
                        "AdamW, batches 8/24/16/32 of 3x64x64")


def _gru_seq2seq_train():
    import torch
    from torch import nn

    V = 3000

    class Seq2Seq(nn.Module):
        def __init__(self, d=192, h=256):
            super().__init__()
            self.src_emb, self.tgt_emb = nn.Embedding(V, d), nn.Embedding(V, d)
            self.enc = nn.GRU(d, h, num_layers=2, batch_first=True, bidirectional=True)
            self.bridge = nn.Linear(2 * h, h)
            self.dec = nn.GRUCell(d + 2 * h, h)
            self.att = nn.Linear(h, 2 * h, bias=False)
            self.out = nn.Linear(h + 2 * h, V)

        def forward(self, src, tgt_in):
            mem, _ = self.enc(self.src_emb(src))                    # b, s, 2h
            hdn = torch.tanh(self.bridge(mem.mean(1)))
            ctx = mem.new_zeros(src.shape[0], mem.shape[2])
            emb = self.tgt_emb(tgt_in)
            logits = []
            for t in range(tgt_in.shape[1]):                        # teacher forcing
                hdn = self.dec(torch.cat([emb[:, t], ctx], 1), hdn)
                w = torch.softmax(torch.bmm(mem, self.att(hdn).unsqueeze(2)).squeeze(2), 1)
                ctx = torch.bmm(w.unsqueeze(1), mem).squeeze(1)
                logits.append(self.out(torch.cat([hdn, ctx], 1)))
            return torch.stack(logits, 1)

    def setup():
        model = Seq2Seq()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for batch, s, t in ((16, 30, 25), (32, 12, 18), (8, 60, 40), (24, 20, 10)):
            src = torch.randint(0, V, (batch, s))
            tgt = torch.randint(0, V, (batch, t + 1))
            opt.zero_grad(set_to_none=True)
            logits = model(src, tgt[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, V), tgt[:, 1:].reshape(-1)).backward()
            opt.step()
    return setup, run, ("GRU seq2seq (2-layer biGRU encoder, GRUCell decoder with dot attention, teacher forcing, "
                        "vocab 3000), Adam, batch/src/tgt 16/30/25, 32/12/18, 8/60/40, 24/20/10")


def _unet_diffusion_train():
    import math
    import torch
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self, i, o, temb):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, i), nn.Conv2d(i, o, 3, padding=1)
            self.t = nn.Linear(temb, o)
            self.n2, self.c2 = nn.GroupNorm(8, o), nn.Conv2d(o, o, 3, padding=1)
            self.skip = nn.Conv2d(i, o, 1) if i != o else nn.Identity()

        def forward(self, x, te):
            h = self.c1(nn.functional.silu(self.n1(x))) + self.t(te)[:, :, None, None]
            h = self.c2(nn.functional.silu(self.n2(h)))
            return h + self.skip(x)

    class UNet(nn.Module):
        def __init__(self, c=(32, 64, 128), temb=128):
            super().__init__()
            self.temb = temb
            self.tmlp = nn.Sequential(nn.Linear(temb, temb), nn.SiLU(), nn.Linear(temb, temb))
            self.inp = nn.Conv2d(3, c[0], 3, padding=1)
            self.down = nn.ModuleList([ResBlock(c[0], c[0], temb), ResBlock(c[0], c[1], temb),
                                       ResBlock(c[1], c[2], temb)])
            self.mid = ResBlock(c[2], c[2], temb)
            self.up = nn.ModuleList([ResBlock(2 * c[2], c[1], temb), ResBlock(2 * c[1], c[0], temb),
                                     ResBlock(2 * c[0], c[0], temb)])
            self.out = nn.Sequential(nn.GroupNorm(8, c[0]), nn.SiLU(), nn.Conv2d(c[0], 3, 3, padding=1))

        def tembed(self, t):
            half = self.temb // 2
            f = torch.exp(-math.log(10000) * torch.arange(half) / half)
            a = t.float()[:, None] * f[None]
            return self.tmlp(torch.cat([a.sin(), a.cos()], 1))

        def forward(self, x, t):
            te = self.tembed(t)
            x = self.inp(x)
            skips = []
            for i, blk in enumerate(self.down):
                x = blk(x, te)
                skips.append(x)
                if i < 2:
                    x = nn.functional.avg_pool2d(x, 2)
            x = self.mid(x, te)
            for i, blk in enumerate(self.up):
                if i > 0:
                    x = nn.functional.interpolate(x, scale_factor=2, mode="nearest")
                x = blk(torch.cat([x, skips[2 - i]], 1), te)
            return self.out(x)

    def setup():
        model = UNet()
        betas = torch.linspace(1e-4, 0.02, 1000)
        abar = torch.cumprod(1 - betas, 0)
        return model, torch.optim.Adam(model.parameters(), lr=2e-4), abar

    def run(state):
        model, opt, abar = state
        for batch, size in ((8, 32), (4, 64), (6, 48)):
            x0 = torch.randn(batch, 3, size, size)
            t = torch.randint(0, 1000, (batch,))
            noise = torch.randn_like(x0)
            a = abar[t][:, None, None, None]
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xt, t), noise).backward()
            opt.step()
    return setup, run, ("3-level diffusion U-Net (ResBlocks w/ GroupNorm, sinusoidal timestep embedding added), "
                        "noise-prediction MSE, Adam, batch x res 8x32, 4x64, 6x48")


def _beam_search_decode():
    import torch
    from torch import nn

    V, D, H, L = 8000, 256, 4, 4

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x, cache):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            if "k" in cache:
                k = torch.cat([cache["k"], k], 2)
                v = torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, D))
            return x + self.mlp(self.ln2(x))

    class Dec(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(512, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

        def forward(self, idx, caches, start):
            x = self.tok(idx) + self.pos(torch.arange(start, start + idx.shape[1]))
            for blk, c in zip(self.blocks, caches):
                x = blk(x, c)
            return self.head(self.ln(x))

    def setup():
        return Dec().eval()

    def run(model):
        beam = 4
        with torch.no_grad():
            for batch, prompt, steps in ((4, 64, 60), (6, 32, 40)):
                src = torch.randint(0, V, (batch, prompt))
                src = src.repeat_interleave(beam, 0)                   # (batch*beam, prompt)
                caches = [dict() for _ in model.blocks]
                logits = model(src, caches, 0)[:, -1]
                scores = torch.zeros(batch, beam)
                scores[:, 1:] = -1e9
                seqs = src
                for step in range(steps):
                    lp = torch.log_softmax(logits, -1).view(batch, beam, V) + scores[:, :, None]
                    scores, flat = lp.view(batch, -1).topk(beam, -1)
                    origin = (flat // V) + torch.arange(batch)[:, None] * beam
                    origin, tok = origin.reshape(-1), (flat % V).reshape(-1, 1)
                    seqs = torch.cat([seqs.index_select(0, origin), tok], 1)
                    for c in caches:                                   # reorder the cache by beam origin
                        c["k"] = c["k"].index_select(0, origin)
                        c["v"] = c["v"].index_select(0, origin)
                    logits = model(tok, caches, prompt + step)[:, -1]
                del caches, logits, seqs
    return setup, run, ("4-layer d=256 decoder (vocab 8000) beam search, width 4, KV cache grown by torch.cat and "
                        "reordered by index_select each step; batch 4 prompt 64 + 60 steps, batch 6 prompt 32 + 40")


def _moe_train():
    import torch
    from torch import nn

    class MoE(nn.Module):
        def __init__(self, d=256, hidden=1024, experts=8, k=2):
            super().__init__()
            self.k = k
            self.gate = nn.Linear(d, experts, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                         for _ in range(experts))

        def forward(self, x):
            probs = torch.softmax(self.gate(x), -1)
            w, idx = probs.topk(self.k, -1)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = (idx == e).nonzero(as_tuple=True)           # varying tokens per expert
                if tok.numel() == 0:
                    continue
                y = expert(x.index_select(0, tok)) * w[tok, slot].unsqueeze(1)
                out = out.index_add(0, tok, y)
            return out

    class Net(nn.Module):
        def __init__(self, d=256):
            super().__init__()
            self.inp = nn.Linear(64, d)
            self.layers = nn.ModuleList(MoE(d) for _ in range(2))
            self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
            self.out = nn.Linear(d, 10)

        def forward(self, x):
            x = self.inp(x)
            for n, m in zip(self.norms, self.layers):
                x = x + m(n(x))
            return self.out(x)

    def setup():
        model = Net()
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def run(state):
        model, opt = state
        for tokens in (2048, 5000, 1200, 3500):
            x, y = torch.randn(tokens, 64), torch.randint(0, 10, (tokens,))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return setup, run, ("2-layer mixture-of-experts MLP (8 experts 256-1024-256, top-2 softmax routing, "
                        "index_select gather / index_add scatter), SGD, tokens 2048/5000/1200/3500")


def _gnn_scatter_train():
    import torch
    from torch import nn

    class MP(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.msg = nn.Linear(2 * i, o)
            self.upd = nn.Linear(i + o, o)

        def forward(self, x, src, dst):
            m = torch.relu(self.msg(torch.cat([x[src], x[dst]], 1)))
            agg = torch.zeros(x.shape[0], m.shape[1]).index_add_(0, dst, m)
            deg = torch.zeros(x.shape[0]).scatter_add_(0, dst, torch.ones(dst.shape[0])).clamp_(min=1)
            return torch.relu(self.upd(torch.cat([x, agg / deg[:, None]], 1)))

    class GNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([MP(32, 128), MP(128, 128), MP(128, 128)])
            self.out = nn.Linear(128, 8)

        def forward(self, x, src, dst):
            for l in self.layers:
                x = l(x, src, dst)
            return self.out(x)

    def setup():
        model = GNN()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(2)
        for nodes, edges in ((4000, 30000), (8000, 70000), (2500, 12000), (6000, 50000)):
            x = torch.randn(nodes, 32, generator=g)
            src = torch.randint(0, nodes, (edges,), generator=g)
            dst = torch.randint(0, nodes, (edges,), generator=g)
            y = torch.randint(0, 8, (nodes,), generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x, src, dst), y).backward()
            opt.step()
    return setup, run, ("3-layer message-passing GNN (edge MLP, index_add_/scatter_add_ mean aggregation), Adam, "
                        "random graphs nodes/edges 4k/30k, 8k/70k, 2.5k/12k, 6k/50k")


def _wide_deep_inference():
    import torch
    from torch import nn

    FIELDS, CARD, DIM, DENSE = 16, 20_000, 32, 13

    class WideDeep(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.Embedding(CARD, DIM) for _ in range(FIELDS))
            self.wide = nn.EmbeddingBag(FIELDS * CARD, 1, mode="sum")
            self.deep = nn.Sequential(nn.Linear(FIELDS * DIM + DENSE, 1024), nn.ReLU(),
                                      nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                      nn.Linear(256, 1))

        def forward(self, cat, dense):
            deep_in = torch.cat([e(cat[:, i]) for i, e in enumerate(self.emb)] + [dense], 1)
            offs = torch.arange(FIELDS) * CARD
            wide = self.wide((cat + offs).reshape(-1), torch.arange(0, cat.numel(), FIELDS))
            return torch.sigmoid(self.deep(deep_in) + wide).squeeze(1)

    def setup():
        return WideDeep().eval()

    def run(model):
        with torch.no_grad():
            for batch in (8192, 2000, 16384, 500, 12000):
                model(torch.randint(0, CARD, (batch, FIELDS)), torch.randn(batch, DENSE))
    return setup, run, ("wide & deep CTR model (16 fields x 20k embeddings dim 32 + wide EmbeddingBag, "
                        "MLP 525-1024-512-256-1) no_grad inference, batches 8192/2000/16384/500/12000")


WORKLOADS: Dict[str, Callable] = {
    "vit_train_varbatch": _vit_train_varbatch,
    "gru_seq2seq_train": _gru_seq2seq_train,
    "unet_diffusion_train": _unet_diffusion_train,
    "beam_search_decode": _beam_search_decode,
    "moe_train": _moe_train,
    "gnn_scatter_train": _gnn_scatter_train,
    "wide_deep_inference": _wide_deep_inference,
}
