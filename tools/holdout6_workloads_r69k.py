#!/usr/bin/env python3
"""The sixth held-out set (helper r69k): eight workloads of program shapes none of the
49 earlier traces has, recorded after every allocator rule was fixed and only measured.

    pip install torch==2.13.0                                   # the CPU wheel
    python tools/holdout6_workloads_r69k.py                     # all eight into tests/test_memory_traces/holdout6_r69k/
    python tools/holdout6_workloads_r69k.py --list
    python tools/holdout6_workloads_r69k.py rnnt_joint_train --out /tmp/traces

Recording is ``tools/record_traces.py``'s (imported, not copied): seeded, one intra-op
thread, the model built outside the recording, the CPU allocator's events paired by
address into the shared JSON format.  The traces sit in their own folder, apart from
``holdout/`` (which ``replay_trace.py --holdout`` and the corpus test read), so they stay a
clean hold-out: replay them with ``python tools/replay_trace.py
tests/test_memory_traces/holdout6_r69k/*.json``.

The eight: GraphSAGE on sampled 2-hop neighbourhoods (subgraph sizes vary with the seeds'
degrees), a mixture-of-depths transformer with early exit (top-k tokens per layer, a
different depth per batch), an RNN-T with its (B, T, U+1, V) joint tensor at varying T and
U and the loss's forward recursion in log space, a 3D U-Net on volumetric patches of two sizes,
an image GPT completing 2D token grids (prefill, then top-k/top-p sampling with a KV cache), MoCo with a 16k-key
memory queue and a momentum encoder, a byte-level LM with chunked local attention over
long sequences, and quantization-aware training with fake-quantized weights and
activations (observers frozen after two steps).  Each returns ``(setup, run, description)``
as the corpus workloads do.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_traces  # noqa: E402  (tools/ is on sys.path)

OUT = os.path.join(record_traces.DEFAULT_OUT, "holdout6_r69k")


def _graphsage_sampled_train():
    import torch
    from torch import nn

    N, F, C = 20_000, 128, 40

    class Sage(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.self_lin, self.nbr_lin = nn.Linear(i, o), nn.Linear(i, o, bias=False)

        def forward(self, h_dst, h_nbr):                          # (n, i), (n, k, i)
            return self.self_lin(h_dst) + self.nbr_lin(h_nbr.mean(1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = Sage(F, 256), Sage(256, C)

    def setup():
        g = torch.Generator().manual_seed(61)
        deg = (torch.rand(N, generator=g).pow(-0.6) * 3).long().clamp(1, 200)     # power-law degrees
        rowptr = torch.cat([torch.zeros(1, dtype=torch.long), deg.cumsum(0)])
        col = torch.randint(0, N, (int(rowptr[-1]),), generator=g)
        feats = torch.randn(N, F, generator=g)
        labels = torch.randint(0, C, (N,), generator=g)
        model = Model()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), rowptr, col, feats, labels

    def sample(rowptr, col, nodes, k, g):                        # k neighbours each, with replacement
        start, deg = rowptr[nodes], rowptr[nodes + 1] - rowptr[nodes]
        pick = (torch.rand(nodes.numel(), k, generator=g) * deg.unsqueeze(1)).long()
        return col[start.unsqueeze(1) + pick]                    # (n, k) global ids

    def run(state):
        model, opt, rowptr, col, feats, labels = state
        g = torch.Generator().manual_seed(62)
        for batch in (1024, 384, 1536, 640, 256, 1200, 900, 1800):
            seeds = torch.randperm(N, generator=g)[:batch]
            n1 = sample(rowptr, col, seeds, 10, g)                # hop 1: (b, 10)
            hop1, inv1 = torch.unique(torch.cat([seeds, n1.flatten()]), return_inverse=True)
            n2 = sample(rowptr, col, hop1, 5, g)                  # hop 2: (|hop1|, 5)
            nodes, inv2 = torch.unique(torch.cat([hop1, n2.flatten()]), return_inverse=True)
            x = feats[nodes]                                      # the sampled subgraph's features
            loc1, loc2 = inv2[:hop1.numel()], inv2[hop1.numel():].view(-1, 5)
            opt.zero_grad(set_to_none=True)
            h = torch.relu(model.l1(x[loc1], x[loc2]))            # layer 1 on every hop-1 node
            h = nn.functional.dropout(h, 0.3)
            out = model.l2(h[inv1[:batch]], h[inv1[batch:].view(batch, 10)])
            nn.functional.cross_entropy(out, labels[seeds]).backward()
            opt.step()
            del h, out, x
    return setup, run, ("GraphSAGE (2 mean-aggregating layers 128-256-40) on mini-batches of sampled 2-hop "
                        "neighbourhoods (fan-out 10 then 5, with replacement) of a 20k-node power-law graph, "
                        "torch.unique relabelling, dropout, Adam; seed batches 1024/384/1536/640/256/1200/900/1800")


def _mixture_of_depths_train():
    import torch
    from torch import nn

    d, heads, V = 256, 4, 5000

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(d, 1)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, capacity):
            b, t, _ = x.shape
            k = max(1, int(t * capacity))
            score = self.router(x).squeeze(-1)                                  # b, t
            top = score.topk(k, dim=1).indices.sort(dim=1).values              # keep causal order
            idx = top.unsqueeze(-1).expand(-1, -1, d)
            sel = x.gather(1, idx)                                              # b, k, d: the routed tokens
            q, kk, v = self.qkv(self.ln1(sel)).view(b, k, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
            h = sel + self.o(a.transpose(1, 2).reshape(b, k, d))
            h = h + self.ff(self.ln2(h))
            w = torch.sigmoid(score.gather(1, top)).unsqueeze(-1)
            return x.scatter_add(1, idx, (h - sel) * w)                         # the rest skip the block

    class Model(nn.Module):
        def __init__(self, layers=6):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(512, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

        def forward(self, idx, depth):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for i, blk in enumerate(self.blocks[:depth]):
                x = blk(x, 1.0 if i % 2 == 0 else 0.25)                          # full / routed layers
            return self.head(self.ln(x))

    def setup():
        model = Model()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(63)
        for batch, seq, depth in ((8, 128, 6), (16, 96, 3), (4, 256, 5), (12, 64, 2), (6, 192, 4)):
            x = torch.randint(0, V, (batch, seq + 1), generator=g)
            opt.zero_grad(set_to_none=True)
            logits = model(x[:, :-1], depth)                                     # early exit at `depth`
            nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
            opt.step()
            del logits
    return setup, run, ("mixture-of-depths transformer (6 blocks d=256, every other block processes only the "
                        "router's top 25% tokens, gathered and scatter-added back) with early exit: depth 6, 3, "
                        "5, 2, 4 for batch x seq 8x128, 16x96, 4x256, 12x64, 6x192; vocab 5000, AdamW")


def _rnnt_joint_train():
    import torch
    from torch import nn

    V, H, FEAT = 512, 320, 80

    class RNNT(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.LSTM(FEAT * 2, H, num_layers=2, batch_first=True)    # 2x frame stacking
            self.emb = nn.Embedding(V, H)
            self.pred = nn.LSTM(H, H, batch_first=True)
            self.j_enc, self.j_pred = nn.Linear(H, H), nn.Linear(H, H, bias=False)
            self.j_out = nn.Linear(H, V)

        def forward(self, feats, labels):                                       # (b, 2T, 80), (b, U)
            b, t2, _ = feats.shape
            enc = self.enc(feats.reshape(b, t2 // 2, 2 * FEAT))[0]              # b, T, H
            blank_first = torch.cat([torch.zeros(b, 1, dtype=torch.long), labels], 1)   # b, U+1
            pred = self.pred(self.emb(blank_first))[0]                          # b, U+1, H
            joint = torch.tanh(self.j_enc(enc).unsqueeze(2) + self.j_pred(pred).unsqueeze(1))
            return self.j_out(joint).log_softmax(-1)                            # b, T, U+1, V

    def rnnt_loss(lp, labels):
        """The RNN-T forward recursion alpha[t, u] = logaddexp(alpha[t-1, u] + blank[t-1, u],
        alpha[t, u-1] + emit[t, u-1]), a lattice column per label: along t it is a linear
        recurrence in log space, solved by logcumsumexp (U+1 steps, not T)."""
        b, T, U1, _ = lp.shape
        blank = lp[..., 0]                                                      # b, T, U+1
        emit = lp[:, :, :-1].gather(3, labels[:, None, :, None].expand(b, T, U1 - 1, 1)).squeeze(-1)
        zero = torch.zeros(b, 1)
        alpha = None
        for u in range(U1):
            cb = torch.cat([zero, blank[:, :-1, u].cumsum(1)], 1)              # blanks before frame t
            if alpha is None:
                alpha = cb                                                      # u = 0: blanks only
            else:
                e = alpha + emit[:, :, u - 1]
                alpha = cb + torch.logcumsumexp(e - cb, 1)
        return -(alpha[:, -1] + blank[:, -1, -1]).mean()

    def setup():
        model = RNNT()
        return model, torch.optim.Adam(model.parameters(), lr=5e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(64)
        for batch, T, U in ((4, 100, 24), (6, 60, 14), (2, 160, 40), (8, 40, 10), (3, 120, 30)):
            feats = torch.randn(batch, 2 * T, FEAT, generator=g)
            labels = torch.randint(1, V, (batch, U), generator=g)
            opt.zero_grad(set_to_none=True)
            lp = model(feats, labels)
            rnnt_loss(lp, labels).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            del lp
    return setup, run, ("RNN-T: 2-layer LSTM encoder (80-dim features, 2x frame stacking, hidden 320), LSTM "
                        "predictor, additive tanh joint to a (B, T, U+1, 512) log-softmax, the loss's forward "
                        "recursion one label at a time (logcumsumexp along T), grad clipping, Adam; "
                        "batch x frames x labels 4x100x24, 6x60x14, 2x160x40, 8x40x10, 3x120x30")


def _unet3d_patch_train():
    import torch
    from torch import nn

    def conv(i, o):
        return nn.Sequential(nn.Conv3d(i, o, 3, padding=1, bias=False), nn.GroupNorm(4, o), nn.LeakyReLU(0.01),
                             nn.Conv3d(o, o, 3, padding=1, bias=False), nn.GroupNorm(4, o), nn.LeakyReLU(0.01))

    class UNet3D(nn.Module):
        def __init__(self, c=(8, 16, 32, 64), classes=4):
            super().__init__()
            self.down = nn.ModuleList([conv(1, c[0])] + [conv(c[i], c[i + 1]) for i in range(3)])
            self.up = nn.ModuleList(nn.ConvTranspose3d(c[i + 1], c[i], 2, 2) for i in range(3))
            self.dec = nn.ModuleList(conv(2 * c[i], c[i]) for i in range(3))
            self.out = nn.Conv3d(c[0], classes, 1)

        def forward(self, x):
            skips = []
            for i, blk in enumerate(self.down):
                x = blk(x if i == 0 else nn.functional.max_pool3d(x, 2))
                skips.append(x)
            for i in (2, 1, 0):
                x = self.dec[i](torch.cat([self.up[i](x), skips[i]], 1))
            return self.out(x)

    def setup():
        model = UNet3D()
        return model, torch.optim.Adam(model.parameters(), lr=2e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(65)
        for batch, size in ((2, 32), (1, 48), (2, 32), (1, 48), (3, 32)):
            vol = torch.randn(batch, 1, size, size, size, generator=g)
            seg = torch.randint(0, 4, (batch, size, size, size), generator=g)
            opt.zero_grad(set_to_none=True)
            logits = model(vol)
            prob = logits.softmax(1)
            onehot = nn.functional.one_hot(seg, 4).permute(0, 4, 1, 2, 3).float()
            inter = (prob * onehot).sum((2, 3, 4))
            dice = 1 - (2 * inter + 1) / (prob.sum((2, 3, 4)) + onehot.sum((2, 3, 4)) + 1)
            loss = nn.functional.cross_entropy(logits, seg) + dice.mean()
            loss.backward()
            opt.step()
            del logits, prob, onehot, loss
    return setup, run, ("3D U-Net (4 levels, channels 8-64, GroupNorm, LeakyReLU, ConvTranspose3d) on "
                        "volumetric patches of two sizes, cross-entropy + soft Dice, Adam; batch x patch "
                        "2x32^3, 1x48^3, 2x32^3, 1x48^3, 3x32^3")


def _image_gpt_topk_sample():
    import torch
    from torch import nn

    d, heads, V, layers = 512, 8, 1024, 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, cache):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.ff(self.ln2(x))

    class ImageGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.cls = nn.Embedding(V, d), nn.Embedding(100, d)
            self.row, self.colm = nn.Embedding(32, d), nn.Embedding(32, d)        # 2D positions
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

        def forward(self, x, caches):
            for blk, c in zip(self.blocks, caches):
                x = blk(x, c)
            return self.head(self.ln(x[:, -1]))

    def setup():
        return ImageGPT().eval()

    def sample(logits, g, k=64, p=0.9, temp=0.9):
        top, idx = (logits / temp).topk(k, -1)                                 # top-k
        probs = top.softmax(-1)
        keep = probs.cumsum(-1) - probs < p                                     # then nucleus within it
        probs = probs * keep
        pick = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=g)
        return idx.gather(-1, pick)

    def run(model):
        g = torch.Generator().manual_seed(66)
        with torch.no_grad():
            for batch, side, known in ((16, 12, 9), (8, 16, 13)):              # complete the lower rows
                caches = [dict() for _ in model.blocks]
                pos = (model.row.weight[:side, None] + model.colm.weight[None, :side]).reshape(side * side, d)
                grid = torch.randint(0, V, (batch, side * side), generator=g)    # the upper rows are given
                cond = model.cls(torch.randint(0, 100, (batch, 1), generator=g))
                n = known * side
                logits = model(torch.cat([cond, model.tok(grid[:, :n]) + pos[:n]], 1), caches)   # prefill
                for i in range(n, side * side):
                    tok = sample(logits, g)
                    grid[:, i] = tok.squeeze(1)
                    logits = model(model.tok(tok) + pos[i], caches)
                del caches, logits, grid, pos, cond
    return setup, run, ("class-conditional image GPT (2 blocks d=512, 1024 VQ codes, row/column position "
                        "embeddings) completing token grids under no_grad: the known upper rows prefilled, the "
                        "rest sampled one token at a time with a torch.cat-grown KV cache, top-64 then top-p "
                        "0.9 at temperature 0.9; batch x grid x known rows 16x12x12x9, 8x16x16x13")


def _moco_queue_train():
    import torch
    from torch import nn

    K, DIM = 16384, 128

    def encoder():
        def stage(i, o, s):
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))
        return nn.Sequential(stage(3, 32, 1), stage(32, 64, 2), stage(64, 128, 2), stage(128, 128, 1),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(128, 256), nn.ReLU(inplace=True), nn.Linear(256, DIM))

    def setup():
        q_enc = encoder()
        k_enc = encoder()
        k_enc.load_state_dict(q_enc.state_dict())
        for p in k_enc.parameters():
            p.requires_grad_(False)
        queue = nn.functional.normalize(torch.randn(DIM, K), dim=0)
        opt = torch.optim.SGD(q_enc.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
        return q_enc, k_enc, queue, opt, [0]

    def augment(x, g):
        b = x.shape[0]
        i, j = (int(v) for v in torch.randint(0, 9, (2,), generator=g))
        crop = x[:, :, i:i + 32, j:j + 32]
        flip = torch.rand(b, 1, 1, 1, generator=g) < 0.5
        jitter = 1 + 0.4 * (torch.rand(b, 3, 1, 1, generator=g) - 0.5)
        return torch.where(flip, crop.flip(3), crop) * jitter

    def run(state):
        q_enc, k_enc, queue, opt, ptr = state
        g = torch.Generator().manual_seed(67)
        for batch in (256, 128, 192, 256, 96):
            imgs = torch.randn(batch, 3, 40, 40, generator=g)
            xq, xk = augment(imgs, g), augment(imgs, g)
            opt.zero_grad(set_to_none=True)
            q = nn.functional.normalize(q_enc(xq), dim=1)
            with torch.no_grad():
                for pq, pk in zip(q_enc.parameters(), k_enc.parameters()):
                    pk.mul_(0.999).add_(pq.detach(), alpha=0.001)               # momentum encoder
                perm = torch.randperm(batch, generator=g)                        # shuffled BN
                k = nn.functional.normalize(k_enc(xk[perm]), dim=1)[perm.argsort()]
            l_pos = (q * k).sum(1, keepdim=True)
            l_neg = q @ queue                                                    # b, K
            logits = torch.cat([l_pos, l_neg], 1) / 0.07
            loss = nn.functional.cross_entropy(logits, torch.zeros(batch, dtype=torch.long))
            loss.backward()
            opt.step()
            with torch.no_grad():                                                # enqueue, dequeue
                idx = (torch.arange(batch) + ptr[0]) % K
                queue[:, idx] = k.t()
                ptr[0] = (ptr[0] + batch) % K
            del q, k, l_neg, logits, loss
    return setup, run, ("MoCo v2-like contrastive learning: 4-stage conv encoder + MLP head (128-d), momentum "
                        "key encoder (EMA 0.999) with shuffled BN, a 128 x 16384 negative queue (in-place "
                        "enqueue), InfoNCE over 1 + 16384 logits, SGD; batches 256/128/192/256/96 of two "
                        "32x32 crops of 3x40x40")


def _chunked_attention_longseq_train():
    import torch
    from torch import nn

    d, heads, V, C = 192, 4, 256, 128                                           # byte-level, chunk 128

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ff = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))

        def forward(self, x, mask):
            b, t, _ = x.shape
            n, dh = t // C, d // heads
            q, k, v = self.qkv(self.ln1(x)).view(b, n, C, 3, heads, dh).permute(3, 0, 4, 1, 2, 5)  # b,h,n,C,dh
            pad = torch.zeros_like(k[:, :, :1])
            k = torch.cat([torch.cat([pad, k[:, :, :-1]], 2), k], 3)           # previous chunk + own
            v = torch.cat([torch.cat([pad, v[:, :, :-1]], 2), v], 3)           # b,h,n,2C,dh
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.o(a.permute(0, 2, 3, 1, 4).reshape(b, t, d))
            return x + self.ff(self.ln2(x))

    class LM(nn.Module):
        def __init__(self, layers=4):
            super().__init__()
            self.tok = nn.Embedding(V, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx)
            i = torch.arange(C)
            local = torch.cat([i[:, None] < i[None, :] + C, i[:, None] >= i[None, :]], 1)   # C, 2C causal
            mask = local.expand(t // C, C, 2 * C).clone()
            mask[0, :, :C] = False                                               # no chunk before the first
            for blk in self.blocks:
                x = blk(x, mask)
            return self.head(self.ln(x))

    def setup():
        model = LM()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(68)
        for batch, seq in ((2, 2048), (1, 4096), (3, 1536), (1, 3072), (4, 1024)):
            x = torch.randint(0, V, (batch, seq + 1), generator=g)
            opt.zero_grad(set_to_none=True)
            logits = model(x[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
            opt.step()
            del logits
    return setup, run, ("byte-level LM over long sequences with chunked local attention (4 blocks d=192, "
                        "chunks of 128 attend to themselves and the previous chunk via a concatenated K/V and a "
                        "mask), AdamW; batch x seq 2x2048, 1x4096, 3x1536, 1x3072, 4x1024")


def _qat_fakequant_train():
    import torch
    from torch import nn

    class ActFQ(nn.Module):
        """Per-tensor affine uint8 fake quantization with an EMA min/max observer."""

        def __init__(self):
            super().__init__()
            self.register_buffer("lo", torch.tensor(0.0))
            self.register_buffer("hi", torch.tensor(0.0))
            self.observe = True
            self.seen = False

        def forward(self, x):
            if self.observe:
                with torch.no_grad():
                    lo, hi = x.min(), x.max()
                    if self.seen:
                        lo, hi = 0.9 * self.lo + 0.1 * lo, 0.9 * self.hi + 0.1 * hi
                    self.lo.copy_(lo.clamp(max=0))
                    self.hi.copy_(hi.clamp(min=0))
                    self.seen = True
            scale = float((self.hi - self.lo).clamp(min=1e-8) / 255)
            zero = int(torch.round(-self.lo / scale).clamp(0, 255))
            return torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 255)

    class QConv(nn.Conv2d):
        """Conv2d whose weight is fake-quantized per output channel (symmetric int8) each forward."""

        def forward(self, x):
            w = self.weight
            scale = (w.detach().abs().amax((1, 2, 3)) / 127).clamp(min=1e-8)
            zero = torch.zeros(w.shape[0], dtype=torch.int32)
            wq = torch.fake_quantize_per_channel_affine(w, scale, zero, 0, -128, 127)
            return self._conv_forward(x, wq, self.bias)

    def block(i, o, s):
        return nn.Sequential(QConv(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(), ActFQ())

    def setup():
        model = nn.Sequential(ActFQ(), block(3, 32, 1), block(32, 32, 1), block(32, 64, 2), block(64, 64, 1),
                              block(64, 128, 2), block(128, 128, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(128, 100))
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(69)
        for step, batch in enumerate((48, 96, 32, 64, 80)):
            if step == 2:                                                        # freeze observers and BN
                for m in model.modules():
                    if isinstance(m, ActFQ):
                        m.observe = False
                    elif isinstance(m, nn.BatchNorm2d):
                        m.eval()
            x, y = torch.randn(batch, 3, 48, 48, generator=g), torch.randint(0, 100, (batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y, label_smoothing=0.1).backward()
            opt.step()
    return setup, run, ("quantization-aware training: 6-conv net with per-channel symmetric int8 fake-quantized "
                        "weights and per-tensor uint8 fake-quantized activations (EMA min/max observers), "
                        "observers and BatchNorm frozen from the third step, SGD Nesterov; batches "
                        "48/96/32/64/80 of 3x48x48")


WORKLOADS: Dict[str, Callable] = {
    "graphsage_sampled_train": _graphsage_sampled_train,
    "mixture_of_depths_train": _mixture_of_depths_train,
    "rnnt_joint_train": _rnnt_joint_train,
    "unet3d_patch_train": _unet3d_patch_train,
    "image_gpt_topk_sample": _image_gpt_topk_sample,
    "moco_queue_train": _moco_queue_train,
    "chunked_attention_longseq_train": _chunked_attention_longseq_train,
    "qat_fakequant_train": _qat_fakequant_train,
}


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", help=f"which to record (default: all of {', '.join(WORKLOADS)})")
    parser.add_argument("--out", default=OUT, help=f"folder for the NAME.json files (default: {OUT})")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, make in WORKLOADS.items():
            print(f"{name:<34}{make()[2]}")
        return 0
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    try:
        import torch
    except ImportError:
        parser.error("torch is needed to record (pip install torch==2.13.0); it is not an accel dependency")
    if not torch.__version__.startswith(record_traces.TORCH_VERSION):
        print(f"warning: torch {torch.__version__}, the traces were recorded with {record_traces.TORCH_VERSION}",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    for name in args.workloads or list(WORKLOADS):
        setup, run, source = WORKLOADS[name]()
        trace = record_traces.record(name, source, setup, run)
        counts = trace.pop("_counts")
        path = os.path.join(args.out, name + ".json")
        record_traces.dump_trace(trace, path)
        print(f"{name}: {len(trace['ops'])} ops, {os.path.getsize(path) / 1024:.0f} KiB; {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
