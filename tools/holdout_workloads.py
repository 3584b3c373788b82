"""Held-out allocation workloads: recorded after the allocator policy was tuned on the
corpus (``tools/record_traces.py``), to check that it generalizes.  Kept apart in
``tests/test_memory_traces/holdout/``; ``python tools/replay_trace.py --holdout`` replays them.

    python tools/record_traces.py --holdout            # every one of them
    python tools/record_traces.py --holdout moe_train

The first seven were used once to choose between two piece rules of expandable segments
(E9 in ``accel/memory/_expandable.py``) and one classic-segment rule; the second seven were
recorded afterwards and only measured (never tuned on, as of their commit); the third eight
were recorded on 2026-12-03 to validate a policy change and only measured; the fourth eight
were recorded on 2026-12-05 as a fresh held-out set (program shapes in none of the others)
and only measured; the fifth eight likewise on 2026-12-06.  Record a fresh set before
tuning on any of them.  Each returns ``(setup, run, description)`` as the corpus workloads do.
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


# ------------------------------------------------ the second batch: recorded, never tuned on

def _t5_style_encdec_train():
    import torch
    from torch import nn

    V, D = 5000, 256

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)                    # shared src/tgt embedding (T5-style)
            self.rel = nn.Embedding(512, D)
            self.tf = nn.Transformer(D, nhead=4, num_encoder_layers=3, num_decoder_layers=3,
                                     dim_feedforward=1024, dropout=0.1, batch_first=True, norm_first=True)
            self.head = nn.Linear(D, V, bias=False)

        def forward(self, src, tgt):
            s = self.emb(src) + self.rel(torch.arange(src.shape[1]))
            t = self.emb(tgt) + self.rel(torch.arange(tgt.shape[1]))
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            return self.head(self.tf(s, t, tgt_mask=mask, tgt_is_causal=True))

    def setup():
        model = EncDec()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def run(state):
        model, opt = state
        # (micro-batch, src, tgt) x 2 micro-batches per optimizer step
        for steps in (((8, 96, 40), (8, 64, 56)), ((4, 200, 30), (4, 150, 80)), ((12, 48, 48), (12, 80, 24))):
            opt.zero_grad(set_to_none=True)
            for b, s, t in steps:
                src = torch.randint(0, V, (b, s))
                tgt = torch.randint(0, V, (b, t + 1))
                logits = model(src, tgt[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, V), tgt[:, 1:].reshape(-1)) / len(steps)
                loss.backward()
                del logits, loss
            opt.step()
    return setup, run, ("T5-style encoder-decoder (nn.Transformer d=256, 3+3 pre-norm layers, shared embedding, "
                        "vocab 5000), AdamW, gradient accumulation over 2 micro-batches; batch/src/tgt "
                        "(8/96/40 + 8/64/56), (4/200/30 + 4/150/80), (12/48/48 + 12/80/24)")


def _conv_vae_train():
    import torch
    from torch import nn

    Z = 64

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2),
                                     nn.Conv2d(32, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.LeakyReLU(0.2),
                                     nn.Conv2d(64, 128, 4, 2, 1), nn.BatchNorm2d(128), nn.LeakyReLU(0.2),
                                     nn.Flatten())
            self.mu, self.logvar = nn.Linear(128 * 8 * 8, Z), nn.Linear(128 * 8 * 8, Z)
            self.fc = nn.Linear(Z, 128 * 8 * 8)
            self.dec = nn.Sequential(nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.ReLU(),
                                     nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
                                     nn.ConvTranspose2d(32, 3, 4, 2, 1))

        def forward(self, x):
            h = self.enc(x)
            mu, logvar = self.mu(h), self.logvar(h)
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)       # reparameterization
            return self.dec(self.fc(z).view(-1, 128, 8, 8)), mu, logvar

    def setup():
        model = VAE()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for batch in (32, 96, 16, 64):
            x = torch.rand(batch, 3, 64, 64)
            opt.zero_grad(set_to_none=True)
            recon, mu, logvar = model(x)
            rec = nn.functional.binary_cross_entropy_with_logits(recon, x, reduction="sum") / batch
            kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / batch
            (rec + kl).backward()
            opt.step()
    return setup, run, ("convolutional VAE (3 strided convs -> mu/logvar z=64 -> 3 transposed convs, BatchNorm), "
                        "reparameterization, BCE recon + KL, Adam, batches 32/96/16/64 of 3x64x64")


def _speech_conformer_like():
    import torch
    from torch import nn

    D, VOC = 144, 40

    class ConvModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.pw1 = nn.Conv1d(D, 2 * D, 1)
            self.dw = nn.Conv1d(D, D, 15, padding=7, groups=D)
            self.bn = nn.BatchNorm1d(D)
            self.pw2 = nn.Conv1d(D, D, 1)

        def forward(self, x):                                           # b, t, d
            h = nn.functional.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
            h = self.pw2(nn.functional.silu(self.bn(self.dw(h))))
            return x + h.transpose(1, 2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff1 = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.SiLU(), nn.Linear(4 * D, D))
            self.ln_att = nn.LayerNorm(D)
            self.att = nn.MultiheadAttention(D, 4, dropout=0.1, batch_first=True)
            self.conv = ConvModule()
            self.ff2 = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.SiLU(), nn.Linear(4 * D, D))
            self.ln = nn.LayerNorm(D)

        def forward(self, x, pad):
            x = x + 0.5 * self.ff1(x)
            h = self.ln_att(x)
            x = x + self.att(h, h, h, key_padding_mask=pad, need_weights=False)[0]
            x = self.conv(x)
            return self.ln(x + 0.5 * self.ff2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = nn.Sequential(nn.Conv1d(80, D, 3, 2, 1), nn.ReLU(), nn.Conv1d(D, D, 3, 2, 1), nn.ReLU())
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.out = nn.Linear(D, VOC)

        def forward(self, feats, lens):                                 # feats: b, 80, T
            x = self.sub(feats).transpose(1, 2)                         # b, T/4, d
            olens = ((lens + 1) // 2 + 1) // 2
            pad = torch.arange(x.shape[1])[None, :] >= olens[:, None]
            for blk in self.blocks:
                x = blk(x, pad)
            return self.out(x).log_softmax(-1), olens

    def setup():
        model = Model()
        return model, torch.optim.AdamW(model.parameters(), lr=5e-4), nn.CTCLoss(blank=0, zero_infinity=True)

    def run(state):
        model, opt, ctc = state
        g = torch.Generator().manual_seed(3)
        for batch, frames in ((8, 1200), (4, 1600), (12, 800), (6, 1400)):
            lens = torch.randint(frames * 3 // 4, frames + 1, (batch,), generator=g)
            lens[0] = frames
            feats = torch.randn(batch, 80, frames, generator=g)
            tlens = torch.randint(20, 60, (batch,), generator=g)
            targets = torch.randint(1, VOC, (int(tlens.sum()),), generator=g)
            opt.zero_grad(set_to_none=True)
            logp, olens = model(feats, lens)
            ctc(logp.transpose(0, 1), targets, olens, tlens).backward()
            opt.step()
    return setup, run, ("conformer-like speech encoder (2x stride-2 Conv1d subsampling of 80-dim features, "
                        "3 blocks of macaron FF + MHA with key padding + depthwise conv module, d=144), "
                        "nn.CTCLoss, AdamW, batch x frames 8x1200, 4x1600, 12x800, 6x1400, variable lengths")


def _detr_like_eval():
    import torch
    from torch import nn

    D, Q = 192, 50

    def stage(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, 2, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(),
                             nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

    class DETR(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(stage(3, 32), stage(32, 64), stage(64, 128), stage(128, 256),
                                          stage(256, 256))
            self.proj = nn.Conv2d(256, D, 1)
            self.row, self.col = nn.Embedding(64, D // 2), nn.Embedding(64, D // 2)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 6, 4 * D, batch_first=True), 2,
                                             enable_nested_tensor=False)
            self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 6, 4 * D, batch_first=True), 4)
            self.query = nn.Embedding(Q, D)
            self.cls = nn.Linear(D, 92)
            self.box = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 4))

        def forward(self, img):
            f = self.proj(self.backbone(img))                           # b, D, h, w
            b, _, h, w = f.shape
            pos = torch.cat([self.col(torch.arange(w))[None].expand(h, -1, -1),
                             self.row(torch.arange(h))[:, None].expand(-1, w, -1)], -1).flatten(0, 1)
            mem = self.enc(f.flatten(2).transpose(1, 2) + pos)
            hs = self.dec(self.query.weight[None].expand(b, -1, -1), mem)
            return self.cls(hs).softmax(-1), self.box(hs).sigmoid()

    def setup():
        return DETR().eval()

    def run(model):
        with torch.no_grad():
            for batch, hgt, wid in ((2, 480, 640), (4, 320, 320), (1, 800, 608), (3, 384, 512)):
                probs, boxes = model(torch.randn(batch, 3, hgt, wid))
                scores, labels = probs[..., :-1].max(-1)
                keep = scores > 0.02
                _ = boxes[keep], labels[keep]
                del probs, boxes, scores, labels, keep
    return setup, run, ("DETR-like detector eval (5-stage stride-32 conv backbone, learned 2-D position embedding, "
                        "2 encoder + 4 decoder layers d=192, 50 object queries, class/box heads, score filter), "
                        "no_grad, batch x HxW 2x480x640, 4x320x320, 1x800x608, 3x384x512")


def _llama_style_prefill_decode():
    import torch
    from torch import nn

    V, D, H, L, FF, MAXLEN = 8000, 384, 6, 4, 1024, 512
    HD = D // H

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

    def rope(x, cos, sin):                                              # x: b, h, t, hd
        x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
            self.w2 = nn.Linear(FF, D, bias=False)

        def forward(self, x, cache, pos, cos, sin):
            b, t, _ = x.shape
            h = self.n1(x)
            q = rope(self.wq(h).view(b, t, H, HD).transpose(1, 2), cos, sin)
            k = rope(self.wk(h).view(b, t, H, HD).transpose(1, 2), cos, sin)
            v = self.wv(h).view(b, t, H, HD).transpose(1, 2)
            idx = torch.arange(pos, pos + t)
            cache["k"].index_copy_(2, idx, k)                           # preallocated KV cache, no torch.cat
            cache["v"].index_copy_(2, idx, v)
            kk, vv = cache["k"][:, :, : pos + t], cache["v"][:, :, : pos + t]
            att = nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=t > 1)
            x = x + self.wo(att.transpose(1, 2).reshape(b, t, D))
            h = self.n2(x)
            return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.norm = RMSNorm()
            self.head = nn.Linear(D, V, bias=False)
            inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
            ang = torch.arange(MAXLEN).float()[:, None] * inv[None]
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, idx, caches, pos):
            t = idx.shape[1]
            cos, sin = self.cos[pos: pos + t], self.sin[pos: pos + t]
            x = self.tok(idx)
            for blk, c in zip(self.blocks, caches):
                x = blk(x, c, pos, cos, sin)
            return self.head(self.norm(x[:, -1:]))

    def setup():
        return Llama().eval()

    def run(model):
        with torch.no_grad():
            for batch, prompt in ((8, 120), (4, 300), (16, 48)):
                caches = [{"k": torch.zeros(batch, H, prompt + 30, HD), "v": torch.zeros(batch, H, prompt + 30, HD)}
                          for _ in model.blocks]
                idx = torch.randint(0, V, (batch, prompt))
                logits = model(idx, caches, 0)
                out = [logits.argmax(-1)]
                for step in range(30):
                    logits = model(out[-1], caches, prompt + step)
                    out.append(logits.argmax(-1))
                del caches, logits, out
    return setup, run, ("LLaMA-style decoder (RMSNorm, rotary embeddings, SwiGLU, 4 layers d=384, vocab 8000) "
                        "no_grad prefill then 30 greedy decode steps into a preallocated KV cache written by "
                        "index_copy_; batch x prompt 8x120, 4x300, 16x48")


def _graph_attention_train():
    import torch
    from torch import nn

    class GATLayer(nn.Module):
        def __init__(self, i, o, heads):
            super().__init__()
            self.h, self.o = heads, o
            self.lin = nn.Linear(i, heads * o, bias=False)
            self.a_src = nn.Parameter(torch.randn(heads, o) * 0.1)
            self.a_dst = nn.Parameter(torch.randn(heads, o) * 0.1)

        def forward(self, x, src, dst):
            n = x.shape[0]
            z = self.lin(x).view(n, self.h, self.o)
            e = nn.functional.leaky_relu((z * self.a_src).sum(-1)[src] + (z * self.a_dst).sum(-1)[dst], 0.2)
            # softmax over the incoming edges of each destination node (segment softmax by scatter)
            emax = torch.full((n, self.h), -1e9).scatter_reduce(0, dst[:, None].expand(-1, self.h), e,
                                                                reduce="amax", include_self=True)
            w = torch.exp(e - emax[dst])
            denom = torch.zeros(n, self.h).index_add_(0, dst, w)
            alpha = w / (denom[dst] + 1e-16)
            out = torch.zeros(n, self.h, self.o).index_add_(0, dst, z[src] * alpha[..., None])
            return out

    class GAT(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = GATLayer(64, 32, 4)
            self.l2 = GATLayer(128, 32, 4)
            self.l3 = GATLayer(128, 16, 1)

        def forward(self, x, src, dst):
            x = nn.functional.elu(self.l1(x, src, dst).flatten(1))
            x = nn.functional.dropout(x, 0.2, self.training)
            x = nn.functional.elu(self.l2(x, src, dst).flatten(1))
            return self.l3(x, src, dst).squeeze(1)

    def setup():
        model = GAT()
        return model, torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=5e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(4)
        for nodes, edges in ((5000, 40000), (12000, 90000), (3000, 15000), (8000, 60000)):
            x = torch.randn(nodes, 64, generator=g)
            src = torch.randint(0, nodes, (edges,), generator=g)
            dst = torch.randint(0, nodes, (edges,), generator=g)
            loops = torch.arange(nodes)
            src, dst = torch.cat([src, loops]), torch.cat([dst, loops])   # self loops
            y = torch.randint(0, 16, (nodes,), generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x, src, dst), y).backward()
            opt.step()
    return setup, run, ("3-layer GAT (4/4/1 heads, edge attention with scatter_reduce amax + index_add_ segment "
                        "softmax, self loops), Adam, random graphs nodes/edges 5k/40k, 12k/90k, 3k/15k, 8k/60k")


def _mixed_precision_like_train():
    import torch
    from torch import nn

    def setup():
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                              nn.LayerNorm(1024), nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 100))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for batch in (512, 1536, 256, 1024):
            x, y = torch.randn(batch, 256), torch.randint(0, 100, (batch,))
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return setup, run, ("MLP 256-1024-1024-512-100 (GELU, LayerNorm) trained under torch.autocast(cpu, bfloat16), "
                        "clip_grad_norm_ 1.0, AdamW, batches 512/1536/256/1024")


# ------------------------------------------------ the third batch: recorded 2026-12-03 to validate a
# policy change, only measured

def _swin_like_train():
    import torch
    from torch import nn

    W = 4                                                               # window side (tokens)

    class WindowAttention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.h, self.scale = heads, (d // heads) ** -0.5
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.table = nn.Parameter(torch.randn((2 * W - 1) ** 2, heads) * 0.02)   # relative position bias
            c = torch.stack(torch.meshgrid(torch.arange(W), torch.arange(W), indexing="ij")).flatten(1)
            rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + (W - 1)
            self.register_buffer("index", rel[..., 0] * (2 * W - 1) + rel[..., 1], persistent=False)

        def forward(self, x, mask):                                     # x: b*nw, W*W, d
            bn, n, d = x.shape
            q, k, v = self.qkv(x).view(bn, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            att = (q * self.scale) @ k.transpose(-2, -1)
            att = att + self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)[None]
            if mask is not None:                                        # shifted windows: no attention across seams
                nw = mask.shape[0]
                att = (att.view(bn // nw, nw, self.h, n, n) + mask[None, :, None]).view(bn, self.h, n, n)
            return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(bn, n, d))

    def windows(x):                                                     # b, H, W, d -> b*nw, W*W, d
        b, hh, ww, d = x.shape
        return x.view(b, hh // W, W, ww // W, W, d).permute(0, 1, 3, 2, 4, 5).reshape(-1, W * W, d)

    def unwindows(x, b, hh, ww):
        d = x.shape[-1]
        return x.view(b, hh // W, ww // W, W, W, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, d)

    masks = {}

    def shift_mask(hh, ww):                                             # per resolution, built once
        if (hh, ww) not in masks:
            s, img, cnt = W // 2, torch.zeros(1, hh, ww, 1), 0
            for hs in (slice(0, -W), slice(-W, -s), slice(-s, None)):
                for ws in (slice(0, -W), slice(-W, -s), slice(-s, None)):
                    img[:, hs, ws] = cnt
                    cnt += 1
            mw = windows(img).squeeze(-1)
            m = mw[:, None, :] - mw[:, :, None]
            masks[hh, ww] = m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0)
        return masks[hh, ww]

    class Block(nn.Module):
        def __init__(self, d, heads, shift):
            super().__init__()
            self.shift = shift
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = WindowAttention(d, heads)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):                                           # b, H, W, d
            b, hh, ww, d = x.shape
            h = self.n1(x)
            if self.shift:
                h = torch.roll(h, (-(W // 2), -(W // 2)), (1, 2))
            h = unwindows(self.attn(windows(h), shift_mask(hh, ww) if self.shift else None), b, hh, ww)
            if self.shift:
                h = torch.roll(h, (W // 2, W // 2), (1, 2))
            x = x + h
            return x + self.mlp(self.n2(x))

    class Merge(nn.Module):                                             # patch merging: 2x2 -> 1, d -> 2d
        def __init__(self, d):
            super().__init__()
            self.norm, self.red = nn.LayerNorm(4 * d), nn.Linear(4 * d, 2 * d, bias=False)

        def forward(self, x):
            x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
            return self.red(self.norm(x))

    class Swin(nn.Module):
        def __init__(self, d=64, classes=100):
            super().__init__()
            self.embed, self.ln0 = nn.Conv2d(3, d, 4, 4), nn.LayerNorm(d)
            self.s1 = nn.Sequential(Block(d, 2, False), Block(d, 2, True))
            self.m1 = Merge(d)
            self.s2 = nn.Sequential(Block(2 * d, 4, False), Block(2 * d, 4, True))
            self.m2 = Merge(2 * d)
            self.s3 = nn.Sequential(Block(4 * d, 8, False), Block(4 * d, 8, True))
            self.ln, self.head = nn.LayerNorm(4 * d), nn.Linear(4 * d, classes)

        def forward(self, img):
            x = self.ln0(self.embed(img).permute(0, 2, 3, 1))
            x = self.s3(self.m2(self.s2(self.m1(self.s1(x)))))
            return self.head(self.ln(x).mean((1, 2)))

    def setup():
        model = Swin()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    def run(state):
        model, opt = state
        for batch, size in ((16, 64), (6, 128), (16, 64), (6, 128)):   # two resolutions, alternating
            x, y = torch.randn(batch, 3, size, size), torch.randint(0, 100, (batch,))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return setup, run, ("Swin-like classifier (4x4 patch embed d=64, 3 stages of window attention 4x4 with "
                        "relative position bias, shifted windows by torch.roll + seam mask, patch merging), "
                        "AdamW, batch x image 16x64, 6x128, 16x64, 6x128 (two resolutions alternating)")


def _nn_transformer_translate_train():
    import math
    import torch
    from torch import nn

    V, D, PAD = 6000, 256, 0

    class Translator(nn.Module):
        def __init__(self):
            super().__init__()
            self.src_emb, self.tgt_emb = nn.Embedding(V, D, padding_idx=PAD), nn.Embedding(V, D, padding_idx=PAD)
            self.tf = nn.Transformer(D, 4, 3, 3, 1024, dropout=0.1, batch_first=True)
            self.out = nn.Linear(D, V)
            pe = torch.zeros(512, D)
            pos = torch.arange(512).float()[:, None]
            div = torch.exp(torch.arange(0, D, 2).float() * (-math.log(10000.0) / D))
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
            self.register_buffer("pe", pe, persistent=False)

        def forward(self, src, tgt):
            s = self.src_emb(src) * math.sqrt(D) + self.pe[: src.shape[1]]
            t = self.tgt_emb(tgt) * math.sqrt(D) + self.pe[: tgt.shape[1]]
            causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)
            h = self.tf(s, t, tgt_mask=causal, src_key_padding_mask=src == PAD,
                        tgt_key_padding_mask=tgt == PAD, memory_key_padding_mask=src == PAD, tgt_is_causal=True)
            return self.out(h)

    def setup():
        model = Translator()
        opt = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-9)
        return model, opt, nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

    def batch_of(g, b, smax, tmax):                                     # padded, lengths vary within the batch
        sl = torch.randint(smax // 2, smax + 1, (b,), generator=g)
        tl = torch.randint(tmax // 2, tmax + 1, (b,), generator=g)
        src = torch.randint(1, V, (b, smax), generator=g).masked_fill(torch.arange(smax) >= sl[:, None], PAD)
        tgt = torch.randint(1, V, (b, tmax + 1), generator=g).masked_fill(torch.arange(tmax + 1) > tl[:, None], PAD)
        return src, tgt

    def run(state):
        model, opt, crit = state
        g = torch.Generator().manual_seed(5)
        for b, smax, tmax in ((32, 40, 36), (12, 96, 80), (48, 18, 22), (20, 64, 50)):
            src, tgt = batch_of(g, b, smax, tmax)
            opt.zero_grad(set_to_none=True)
            logits = model(src, tgt[:, :-1])
            crit(logits.reshape(-1, V), tgt[:, 1:].reshape(-1)).backward()
            opt.step()
    return setup, run, ("nn.Transformer translation model (3+3 layers d=256, sinusoidal positions, padding and "
                        "causal masks, vocab 6000), label-smoothed cross entropy ignoring padding, Adam; "
                        "batch/max src/max tgt 32/40/36, 12/96/80, 48/18/22, 20/64/50, lengths varying per sentence")


def _wavenet_like_train():
    import torch
    from torch import nn

    R, S, Q = 32, 64, 256                                               # residual, skip channels, mu-law classes
    DILATIONS = [2 ** i for i in range(8)] * 2

    class Layer(nn.Module):
        def __init__(self, dil):
            super().__init__()
            self.dil = dil
            self.conv = nn.Conv1d(R, 2 * R, 2, dilation=dil)
            self.res, self.skip = nn.Conv1d(R, R, 1), nn.Conv1d(R, S, 1)

        def forward(self, x):
            h = self.conv(nn.functional.pad(x, (self.dil, 0)))          # causal: pad on the left only
            f, g = h.chunk(2, 1)
            h = torch.tanh(f) * torch.sigmoid(g)                        # gated activation
            return x + self.res(h), self.skip(h)

    class WaveNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(Q, R)
            self.layers = nn.ModuleList(Layer(d) for d in DILATIONS)
            self.post = nn.Sequential(nn.ReLU(), nn.Conv1d(S, S, 1), nn.ReLU(), nn.Conv1d(S, Q, 1))

        def forward(self, q):                                           # q: b, T (mu-law codes)
            x = self.emb(q).transpose(1, 2)
            skip = 0
            for layer in self.layers:
                x, s = layer(x)
                skip = skip + s
            return self.post(skip)

    def mulaw(a):
        return ((torch.sign(a) * torch.log1p(255 * a.abs()) / torch.log1p(torch.tensor(255.0)) + 1) * 127.5).long()

    def setup():
        model = WaveNet()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(6)
        for batch, length in ((4, 4000), (2, 9000), (6, 2500), (3, 6000)):
            t = torch.arange(length + 1).float()
            f = torch.rand(batch, 1, generator=g) * 0.05 + 0.01
            audio = (0.6 * torch.sin(t * f) + 0.05 * torch.randn(batch, length + 1, generator=g)).clamp(-1, 1)
            q = mulaw(audio)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(q[:, :-1]), q[:, 1:]).backward()
            opt.step()
    return setup, run, ("WaveNet-like autoregressive audio model (mu-law 256 embedding, 2 stacks of dilated causal "
                        "Conv1d 1..128, tanh*sigmoid gates, residual and summed skip connections, 32/64 channels), "
                        "Adam, batch x samples 4x4000, 2x9000, 6x2500, 3x6000")


def _dlrm_like_train():
    import torch
    from torch import nn

    TABLES, DIM, DENSE = (100_000, 40_000, 20_000, 8_000, 3_000, 1_000, 300, 50), 64, 13

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in TABLES)
            self.bot = nn.Sequential(nn.Linear(DENSE, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                                     nn.Linear(128, DIM), nn.ReLU())
            f = len(TABLES) + 1
            self.register_buffer("li", torch.tril_indices(f, f, -1), persistent=False)
            self.top = nn.Sequential(nn.Linear(DIM + f * (f - 1) // 2, 256), nn.ReLU(), nn.Linear(256, 128),
                                     nn.ReLU(), nn.Linear(128, 1))

        def forward(self, dense, bags):
            x = self.bot(dense)
            feats = torch.stack([x] + [e(ids, offs) for e, (ids, offs) in zip(self.emb, bags)], 1)   # b, f, DIM
            z = torch.bmm(feats, feats.transpose(1, 2))                 # pairwise dot interaction
            inter = z[:, self.li[0], self.li[1]]
            return self.top(torch.cat([x, inter], 1)).squeeze(1)

    def setup():
        model = DLRM()
        sparse = torch.optim.Adagrad([p for e in model.emb for p in e.parameters()], lr=0.05)
        dense = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("emb")], lr=0.05)
        return model, sparse, dense

    def run(state):
        model, sparse, dense = state
        g = torch.Generator().manual_seed(7)
        for batch, hot in ((4096, 4), (1024, 12), (8192, 2), (2048, 8)):
            bags = []
            for n in TABLES:
                lengths = torch.randint(1, 2 * hot, (batch,), generator=g)
                offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
                bags.append((torch.randint(0, n, (int(lengths.sum()),), generator=g), offs))
            x = torch.log1p(torch.rand(batch, DENSE, generator=g) * 100)
            y = (torch.rand(batch, generator=g) < 0.25).float()
            sparse.zero_grad(set_to_none=True)
            dense.zero_grad(set_to_none=True)
            nn.functional.binary_cross_entropy_with_logits(model(x, bags), y).backward()
            sparse.step()
            dense.step()
    return setup, run, ("DLRM-like CTR model (8 sparse EmbeddingBag tables 100k..50 rows dim 64 with Adagrad on "
                        "sparse grads, bottom MLP 13-256-128-64, pairwise dot interaction by bmm + tril gather, top "
                        "MLP 100-256-128-1 with SGD), batches 4096/1024/8192/2048, multi-hot bags of varying length")


def _ppo_rollout_train():
    import torch
    from torch import nn

    A, GAMMA, LAM, CLIP = 6, 0.99, 0.95, 0.2

    class ActorCritic(nn.Module):                                       # Nature-DQN torso, Atari 4x84x84 frames
        def __init__(self):
            super().__init__()
            self.torso = nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                       nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(),
                                       nn.Linear(3136, 512), nn.ReLU())
            self.pi, self.v = nn.Linear(512, A), nn.Linear(512, 1)

        def forward(self, obs_u8):
            h = self.torso(obs_u8.float() / 255.0)
            return self.pi(h), self.v(h).squeeze(1)

    class FakeAtari:                                                    # deterministic stand-in environment
        def __init__(self, n, g):
            self.g, self.n = g, n
            self.obs = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g)

        def step(self, action):
            frame = (self.obs[:, -1:].int() + action.view(-1, 1, 1, 1) * 17
                     + torch.randint(0, 8, (self.n, 1, 84, 84), generator=self.g)).remainder(256).to(torch.uint8)
            self.obs = torch.cat([self.obs[:, 1:], frame], 1)           # frame stack: drop the oldest
            reward = (action == 2).float() - 0.01
            done = torch.rand(self.n, generator=self.g) < 0.02
            return self.obs, reward, done

    def setup():
        model = ActorCritic()
        return model, torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(8)
        for envs, steps, minibatch in ((16, 12, 64), (4, 24, 32), (1, 32, 16), (8, 12, 48)):
            env = FakeAtari(envs, g)
            obs_buf = torch.zeros(steps, envs, 4, 84, 84, dtype=torch.uint8)
            act_buf = torch.zeros(steps, envs, dtype=torch.long)
            logp_buf, val_buf = torch.zeros(steps, envs), torch.zeros(steps, envs)
            rew_buf, done_buf = torch.zeros(steps, envs), torch.zeros(steps, envs)
            obs = env.obs
            with torch.no_grad():                                       # rollout: many tiny forward passes
                for t in range(steps):
                    logits, value = model(obs)
                    dist = torch.distributions.Categorical(logits=logits)
                    action = dist.sample()
                    obs_buf[t], act_buf[t], logp_buf[t], val_buf[t] = obs, action, dist.log_prob(action), value
                    obs, reward, done = env.step(action)
                    rew_buf[t], done_buf[t] = reward, done.float()
                _, last = model(obs)
                adv, gae = torch.zeros(steps, envs), torch.zeros(envs)
                for t in reversed(range(steps)):                        # generalized advantage estimation
                    nxt = last if t == steps - 1 else val_buf[t + 1]
                    nonterm = 1.0 - done_buf[t]
                    delta = rew_buf[t] + GAMMA * nxt * nonterm - val_buf[t]
                    gae = delta + GAMMA * LAM * nonterm * gae
                    adv[t] = gae
                ret = adv + val_buf
            n = steps * envs
            b_obs, b_act = obs_buf.view(n, 4, 84, 84), act_buf.view(n)
            b_logp, b_adv, b_ret = logp_buf.view(n), adv.view(n), ret.view(n)
            for _ in range(2):                                          # PPO epochs over shuffled minibatches
                perm = torch.randperm(n, generator=g)
                for i in range(0, n, minibatch):
                    idx = perm[i: i + minibatch]
                    logits, value = model(b_obs[idx])
                    dist = torch.distributions.Categorical(logits=logits)
                    ratio = torch.exp(dist.log_prob(b_act[idx]) - b_logp[idx])
                    a = b_adv[idx]
                    a = (a - a.mean()) / (a.std() + 1e-8) if a.numel() > 1 else a
                    pg = -torch.min(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).mean()
                    loss = pg + 0.5 * (value - b_ret[idx]).pow(2).mean() - 0.01 * dist.entropy().mean()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
            del env, obs, obs_buf, b_obs
    return setup, run, ("PPO on a stand-in Atari env (Nature-DQN conv actor-critic on uint8 4x84x84 frame stacks): "
                        "no_grad rollouts of batch 16/4/1/8 envs x 12/24/32/12 steps, GAE, then 2 epochs of "
                        "clipped-objective minibatch updates (64/32/16/48), clip_grad_norm_, Adam")


def _ssm_scan_train():
    import torch
    from torch import nn

    V, D, N, E = 1000, 96, 16, 2                                        # vocab, model dim, state size, expansion

    class SelectiveSSM(nn.Module):                                      # Mamba-like block, scan as a Python loop
        def __init__(self):
            super().__init__()
            di = E * D
            self.norm = nn.LayerNorm(D)
            self.inp = nn.Linear(D, 2 * di, bias=False)
            self.conv = nn.Conv1d(di, di, 4, padding=3, groups=di)
            self.xproj = nn.Linear(di, 8 + 2 * N, bias=False)
            self.dt = nn.Linear(8, di)
            self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1).float()).repeat(di, 1))
            self.Dskip = nn.Parameter(torch.ones(di))
            self.out = nn.Linear(di, D, bias=False)

        def forward(self, u):                                           # u: b, L, D
            b, L, _ = u.shape
            x, z = self.inp(self.norm(u)).chunk(2, -1)
            x = nn.functional.silu(self.conv(x.transpose(1, 2))[..., :L].transpose(1, 2))
            dt, B, C = self.xproj(x).split([8, N, N], -1)
            dt = nn.functional.softplus(self.dt(dt))                    # b, L, di
            A = -torch.exp(self.A_log)                                  # di, N
            h = u.new_zeros(b, x.shape[-1], N)
            ys = []
            for t in range(L):                                          # sequential selective scan
                h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t, :, None] * B[:, t, None, :]) * x[:, t, :, None]
                ys.append((h @ C[:, t, :, None]).squeeze(-1))
            y = torch.stack(ys, 1) + x * self.Dskip
            return u + self.out(y * nn.functional.silu(z))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.layers = nn.ModuleList(SelectiveSSM() for _ in range(2))
            self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    def setup():
        model = LM()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        for batch, seq in ((8, 32), (4, 64), (16, 16), (6, 48)):
            x = torch.randint(0, V, (batch, seq + 1))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return setup, run, ("Mamba-like selective state-space LM (2 layers d=96, expansion 2, state 16, depthwise causal "
                        "conv, input-dependent dt/B/C, recurrent scan as a Python loop over time with small per-step "
                        "tensors), backward through the loop, AdamW; batch x seq 8x32, 4x64, 16x16, 6x48")


def _mobilenet_eval_varsize():
    import torch
    from torch import nn

    def cbr(i, o, k=3, s=1, groups=1, act=True):
        layers = [nn.Conv2d(i, o, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(o)]
        return nn.Sequential(*layers, nn.ReLU6(inplace=True)) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):                                  # expand 1x1, depthwise 3x3, project 1x1
        def __init__(self, i, o, s, t):
            super().__init__()
            h = i * t
            self.use_res = s == 1 and i == o
            self.body = nn.Sequential(*([cbr(i, h, 1)] if t != 1 else []), cbr(h, h, 3, s, groups=h),
                                      cbr(h, o, 1, act=False))

        def forward(self, x):
            return x + self.body(x) if self.use_res else self.body(x)

    class MobileNetV2(nn.Module):
        def __init__(self, width=0.75, classes=1000):
            super().__init__()
            c = lambda n: max(8, int(n * width + 4) // 8 * 8)
            layers, i = [cbr(3, c(32), 3, 2)], c(32)
            for t, o, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                               (6, 160, 3, 2), (6, 320, 1, 1)):
                for j in range(n):
                    layers.append(InvertedResidual(i, c(o), s if j == 0 else 1, t))
                    i = c(o)
            layers.append(cbr(i, 1280, 1))
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

        def forward(self, x):
            return self.classifier(nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1))

    def setup():
        return MobileNetV2().eval()

    def run(model):
        with torch.no_grad():
            for batch, size in ((8, 224), (16, 160), (2, 384), (12, 192), (1, 512), (4, 288)):
                probs = model(torch.randn(batch, 3, size, size)).softmax(-1)
                _ = probs.topk(5, -1)
                del probs
    return setup, run, ("MobileNetV2-like net (width 0.75, inverted residuals: 1x1 expand, depthwise 3x3, linear "
                        "1x1 projection, ReLU6, BatchNorm) eval under no_grad, softmax top-5, batch x image "
                        "8x224, 16x160, 2x384, 12x192, 1x512, 4x288")


def _gan_train():
    import torch
    from torch import nn

    Z, NG, ND = 100, 32, 32

    def setup():
        gen = nn.Sequential(nn.ConvTranspose2d(Z, NG * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(NG * 8), nn.ReLU(True),
                            nn.ConvTranspose2d(NG * 8, NG * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(NG * 4),
                            nn.ReLU(True),
                            nn.ConvTranspose2d(NG * 4, NG * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NG * 2),
                            nn.ReLU(True),
                            nn.ConvTranspose2d(NG * 2, NG, 4, 2, 1, bias=False), nn.BatchNorm2d(NG), nn.ReLU(True),
                            nn.ConvTranspose2d(NG, 3, 4, 2, 1, bias=False), nn.Tanh())
        disc = nn.Sequential(nn.Conv2d(3, ND, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
                             nn.Conv2d(ND, ND * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ND * 2),
                             nn.LeakyReLU(0.2, True),
                             nn.Conv2d(ND * 2, ND * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ND * 4),
                             nn.LeakyReLU(0.2, True),
                             nn.Conv2d(ND * 4, ND * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ND * 8),
                             nn.LeakyReLU(0.2, True),
                             nn.Conv2d(ND * 8, 1, 4, 1, 0, bias=False), nn.Flatten())
        opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return gen, disc, opt_g, opt_d

    def run(state):
        gen, disc, opt_g, opt_d = state
        bce = nn.functional.binary_cross_entropy_with_logits
        for batch in (64, 32, 96, 48):
            real = torch.rand(batch, 3, 64, 64) * 2 - 1
            ones, zeros = torch.ones(batch, 1), torch.zeros(batch, 1)
            fake = gen(torch.randn(batch, Z, 1, 1))
            opt_d.zero_grad(set_to_none=True)                           # discriminator: real vs detached fake
            (bce(disc(real), ones) + bce(disc(fake.detach()), zeros)).backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=True)                           # generator: fool the updated discriminator
            bce(disc(fake), ones).backward()
            opt_g.step()
            del fake
    return setup, run, ("DCGAN (64x64, transposed-conv generator z=100 and strided-conv discriminator, 32 base "
                        "channels, BatchNorm), alternating D and G steps with two Adam optimizers, "
                        "batches 64/32/96/48")


def _resnet_sgd_train_varbatch():
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, i, o, s):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o)
            self.c2, self.b2 = nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o)
            self.short = (nn.Sequential(nn.Conv2d(i, o, 1, s, bias=False), nn.BatchNorm2d(o))
                          if s != 1 or i != o else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.short(x))

    def setup():
        layers, i = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True)], 32
        for o, s in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1)):
            layers.append(BasicBlock(i, o, s))
            i = o
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
        return model, opt

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(15)
        for _ in range(4):                                              # batch drawn per step in [12, 80]
            batch = int(torch.randint(12, 81, (1,), generator=g))
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 100, (batch,))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y, label_smoothing=0.1).backward()
            opt.step()
    return setup, run, ("ResNet-18-style CIFAR net (8 basic blocks, widths 32-256, projection shortcuts, BatchNorm), "
                        "SGD nesterov momentum + weight decay, label smoothing, 4 steps of batch drawn in [12, 80] "
                        "of 3x32x32")


def _bert_infer_dynamic_padding():
    import torch
    from torch import nn

    V, D, H, L = 8000, 256, 4, 6

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.typ = nn.Embedding(V, D), nn.Embedding(512, D), nn.Embedding(2, D)
            self.ln = nn.LayerNorm(D)
            self.layers = nn.ModuleList(nn.ModuleDict(dict(
                qkv=nn.Linear(D, 3 * D), o=nn.Linear(D, D), ln1=nn.LayerNorm(D),
                ff=nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)), ln2=nn.LayerNorm(D)))
                for _ in range(L))
            self.pool, self.cls = nn.Linear(D, D), nn.Linear(D, 3)

        def forward(self, ids, mask):                                   # post-norm BERT, padding mask
            b, t = ids.shape
            x = self.ln(self.tok(ids) + self.pos(torch.arange(t)) + self.typ(torch.zeros_like(ids)))
            att_mask = mask[:, None, None, :]                           # b, 1, 1, t (True = attend)
            for lyr in self.layers:
                q, k, v = lyr["qkv"](x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
                a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=att_mask)
                x = lyr["ln1"](x + lyr["o"](a.transpose(1, 2).reshape(b, t, D)))
                x = lyr["ln2"](x + lyr["ff"](x))
            return self.cls(torch.tanh(self.pool(x[:, 0])))

    def setup():
        return Encoder().eval()

    def run(model):
        g = torch.Generator().manual_seed(16)
        with torch.inference_mode():
            for batch in (32, 16, 48, 8, 24, 32):
                lens = torch.randint(6, 257, (batch,), generator=g)
                t = int(lens.max())                                     # pad to the longest in this batch only
                ids = torch.randint(1, V, (batch, t), generator=g)
                mask = torch.arange(t)[None, :] < lens[:, None]
                ids = ids.masked_fill(~mask, 0)
                probs = model(ids, mask).softmax(-1)
                _ = probs.argmax(-1).tolist()
                del ids, mask, probs
    return setup, run, ("BERT-like 6-layer d=256 post-norm encoder inference (inference_mode) with dynamic padding: "
                        "per batch (32/16/48/8/24/32) random lengths in [6, 256], padded to that batch's longest, "
                        "boolean attention mask into SDPA, pooler + 3-way classifier")


def _lstm_tbptt_train():
    import torch
    from torch import nn

    V, E, Hd = 6000, 256, 384

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E)
            self.rnn = nn.LSTM(E, Hd, num_layers=2, dropout=0.2)
            self.proj = nn.Linear(Hd, E)
            self.out = nn.Linear(E, V)
            self.out.weight = self.emb.weight                           # tied embeddings

        def forward(self, x, hidden):                                   # x: seq, batch
            y, hidden = self.rnn(nn.functional.dropout(self.emb(x), 0.1, self.training), hidden)
            return self.out(self.proj(y)), hidden

    def setup():
        model = LM()
        return model, torch.optim.SGD(model.parameters(), lr=20.0)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(17)
        batch = 24
        stream = torch.randint(0, V, (400, batch), generator=g)        # batchified token stream (time-major)
        hidden, pos = None, 0
        for _ in range(6):                                              # AWD-LSTM-style variable BPTT windows
            bptt = 35 if float(torch.rand(1, generator=g)) < 0.9 else 18
            bptt = max(5, int(bptt + 5 * float(torch.randn(1, generator=g))))
            x, y = stream[pos:pos + bptt], stream[pos + 1:pos + 1 + bptt]
            pos += bptt
            if hidden is not None:                                      # truncated BPTT: cut the graph
                hidden = tuple(h.detach() for h in hidden)
            opt.zero_grad(set_to_none=True)
            logits, hidden = model(x, hidden)
            nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
    return setup, run, ("2-layer LSTM LM (vocab 6000, emb 256 tied, hidden 384, time-major) with truncated BPTT over "
                        "one token stream, batch 24: 6 chunks of AWD-LSTM-style random length, hidden state "
                        "carried and detached each chunk, clip_grad_norm_, plain SGD")


def _diffusion_cfg_sampler():
    import math

    import torch
    from torch import nn

    C, NCLS = 48, 10

    class Res(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, i), nn.Conv2d(i, o, 3, 1, 1)
            self.t = nn.Linear(4 * C, o)
            self.n2, self.c2 = nn.GroupNorm(8, o), nn.Conv2d(o, o, 3, 1, 1)
            self.skip = nn.Conv2d(i, o, 1) if i != o else nn.Identity()

        def forward(self, x, emb):
            h = self.c1(nn.functional.silu(self.n1(x))) + self.t(emb)[:, :, None, None]
            return self.skip(x) + self.c2(nn.functional.silu(self.n2(h)))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = nn.Sequential(nn.Linear(C, 4 * C), nn.SiLU(), nn.Linear(4 * C, 4 * C))
            self.cemb = nn.Embedding(NCLS + 1, 4 * C)                   # the last class is "unconditional"
            self.inp = nn.Conv2d(3, C, 3, 1, 1)
            self.d1, self.d2, self.d3 = Res(C, C), Res(C, 2 * C), Res(2 * C, 4 * C)
            self.mid = Res(4 * C, 4 * C)
            self.u3, self.u2, self.u1 = Res(8 * C, 2 * C), Res(4 * C, C), Res(2 * C, C)
            self.out = nn.Sequential(nn.GroupNorm(8, C), nn.SiLU(), nn.Conv2d(C, 3, 3, 1, 1))

        def forward(self, x, t, c):
            half = C // 2
            f = torch.exp(-math.log(10000) * torch.arange(half) / half)
            emb = self.temb(torch.cat([torch.sin(t[:, None] * f), torch.cos(t[:, None] * f)], 1)) + self.cemb(c)
            h1 = self.d1(self.inp(x), emb)
            h2 = self.d2(nn.functional.avg_pool2d(h1, 2), emb)
            h3 = self.d3(nn.functional.avg_pool2d(h2, 2), emb)
            h = self.mid(nn.functional.avg_pool2d(h3, 2), emb)
            h = self.u3(torch.cat([nn.functional.interpolate(h, scale_factor=2.0), h3], 1), emb)
            h = self.u2(torch.cat([nn.functional.interpolate(h, scale_factor=2.0), h2], 1), emb)
            h = self.u1(torch.cat([nn.functional.interpolate(h, scale_factor=2.0), h1], 1), emb)
            return self.out(h)

    def setup():
        return UNet().eval()

    def run(model):
        abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
        ts = torch.linspace(999, 0, 20).long()
        with torch.no_grad():
            for batch, size, scale in ((4, 64, 3.0), (2, 96, 5.0)):
                x = torch.randn(batch, 3, size, size)
                labels = torch.randint(0, NCLS, (batch,))
                c = torch.cat([labels, torch.full((batch,), NCLS)])     # conditional + unconditional halves
                for i, t in enumerate(ts):                              # DDIM, eta 0
                    eps_c, eps_u = model(torch.cat([x, x]), t.repeat(2 * batch).float(), c).chunk(2)
                    eps = eps_u + scale * (eps_c - eps_u)               # classifier-free guidance
                    a, a_prev = abar[t], (abar[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0))
                    x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
                    x = a_prev.sqrt() * x0.clamp(-1, 1) + (1 - a_prev).sqrt() * eps
                    del eps_c, eps_u, eps, x0
                img = ((x + 1) * 127.5).clamp(0, 255).to(torch.uint8)
                del x, img
    return setup, run, ("class-conditional diffusion sampler: small U-Net (3 levels, C=48, GroupNorm, time + class "
                        "embeddings) under no_grad, 20 DDIM steps with classifier-free guidance (batch doubled by "
                        "torch.cat each step, then chunked), batch x image 4x64 then 2x96, uint8 output")


def _clip_contrastive_train():
    import torch
    from torch import nn

    V, T, D, P = 4000, 32, 192, 128

    class ImageTower(nn.Module):
        def __init__(self):
            super().__init__()
            def cbr(i, o, s):
                return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))
            self.net = nn.Sequential(cbr(3, 32, 2), cbr(32, 64, 2), cbr(64, 64, 1), cbr(64, 128, 2),
                                     cbr(128, 128, 1), cbr(128, 256, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.proj = nn.Linear(256, P, bias=False)

        def forward(self, x):
            return self.proj(self.net(x))

    class TextTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, D), nn.Parameter(torch.randn(T, D) * 0.01)
            layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=True)
            self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
            self.ln, self.proj = nn.LayerNorm(D), nn.Linear(D, P, bias=False)

        def forward(self, ids, eot):
            t = ids.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(t)
            x = self.ln(self.enc(self.tok(ids) + self.pos[:t], mask=mask, is_causal=True))
            return self.proj(x[torch.arange(ids.shape[0]), eot])        # features at the end-of-text token

    def setup():
        img, txt = ImageTower(), TextTower()
        logit_scale = nn.Parameter(torch.tensor(2.659))
        params = list(img.parameters()) + list(txt.parameters()) + [logit_scale]
        return img, txt, logit_scale, torch.optim.AdamW(params, lr=5e-4, weight_decay=0.2)

    def run(state):
        img, txt, logit_scale, opt = state
        g = torch.Generator().manual_seed(19)
        for batch in (96, 64, 128):
            images = torch.randn(batch, 3, 64, 64, generator=g)
            ids = torch.randint(1, V, (batch, T), generator=g)
            eot = torch.randint(4, T, (batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            fi = nn.functional.normalize(img(images), dim=-1)
            ft = nn.functional.normalize(txt(ids, eot), dim=-1)
            logits = logit_scale.exp().clamp(max=100) * fi @ ft.t()   # batch x batch similarities
            labels = torch.arange(batch)
            loss = (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.t(), labels)) / 2
            loss.backward()
            opt.step()
    return setup, run, ("CLIP-like contrastive training: conv image tower (6 conv-BN-ReLU, 64x64) and 3-layer causal "
                        "text transformer (d=192, 32 tokens, EOT pooling), normalized projections, learned logit "
                        "scale, batch x batch similarity matrix with symmetric cross-entropy, AdamW, "
                        "batches 96/64/128")


def _convnext_grad_accum_train():
    import torch
    from torch import nn

    class LN2d(nn.LayerNorm):                                           # channels-first LayerNorm via permutes
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.dw = nn.Conv2d(d, d, 7, 1, 3, groups=d)
            self.ln = nn.LayerNorm(d)
            self.pw1, self.pw2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.gamma = nn.Parameter(torch.full((d,), 1e-6))

        def forward(self, x):
            y = self.dw(x).permute(0, 2, 3, 1)                          # NHWC for the MLP
            y = self.pw2(nn.functional.gelu(self.pw1(self.ln(y)))) * self.gamma
            return x + y.permute(0, 3, 1, 2)

    def setup():
        dims = (48, 96, 192, 384)
        layers = [nn.Conv2d(3, dims[0], 4, 4), LN2d(dims[0])]
        for i, (d, n) in enumerate(zip(dims, (2, 2, 4, 2))):
            if i:
                layers += [LN2d(dims[i - 1]), nn.Conv2d(dims[i - 1], d, 2, 2)]
            layers += [Block(d) for _ in range(n)]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1]),
                              nn.Linear(dims[-1], 200))
        return model, torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.05)

    def run(state):
        model, opt = state
        for micro in ((12, 5, 9), (16, 3), (7, 7, 7, 2)):             # uneven micro-batches per optimizer step
            total = sum(micro)
            opt.zero_grad(set_to_none=True)
            for mb in micro:                                            # .grad accumulates across micro-batches
                x, y = torch.randn(mb, 3, 128, 128), torch.randint(0, 200, (mb,))
                (nn.functional.cross_entropy(model(x), y) * (mb / total)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return setup, run, ("ConvNeXt-like classifier (patchify stem, depthwise 7x7 + LayerNorm + inverted MLP blocks, "
                        "dims 48-384, 128x128 images) with gradient accumulation over uneven micro-batches "
                        "(12+5+9, 16+3, 7+7+7+2), clip_grad_norm_, AdamW")


def _tcn_forecast_train():
    import torch
    from torch import nn
    from torch.nn.utils.parametrizations import weight_norm

    CIN, HID, HORIZON = 21, 64, 24

    class TemporalBlock(nn.Module):
        def __init__(self, i, o, dil):
            super().__init__()
            self.pad = 2 * dil                                          # kernel 3, causal (left) padding
            self.c1 = weight_norm(nn.Conv1d(i, o, 3, dilation=dil))
            self.c2 = weight_norm(nn.Conv1d(o, o, 3, dilation=dil))
            self.down = nn.Conv1d(i, o, 1) if i != o else nn.Identity()

        def forward(self, x):
            y = nn.functional.dropout(torch.relu(self.c1(nn.functional.pad(x, (self.pad, 0)))), 0.1, self.training)
            y = nn.functional.dropout(torch.relu(self.c2(nn.functional.pad(y, (self.pad, 0)))), 0.1, self.training)
            return torch.relu(y + self.down(x))

    class TCN(nn.Module):
        def __init__(self):
            super().__init__()
            chans = [CIN] + [HID] * 7
            self.blocks = nn.Sequential(*(TemporalBlock(chans[i], chans[i + 1], 2 ** i) for i in range(7)))
            self.head = nn.Linear(HID, CIN * HORIZON)

        def forward(self, x):                                           # x: b, CIN, L -> b, HORIZON, CIN
            return self.head(self.blocks(x)[:, :, -1]).view(-1, HORIZON, CIN)

    def setup():
        model = TCN()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(21)
        series = torch.randn(CIN, 6000, generator=g).cumsum(1) * 0.05  # one long multivariate random walk
        for batch, window in ((32, 512), (64, 256), (16, 1024), (48, 384)):
            starts = torch.randint(0, series.shape[1] - window - HORIZON, (batch,), generator=g)
            idx = starts[:, None] + torch.arange(window + HORIZON)
            seg = series[:, idx].permute(1, 0, 2)                       # b, CIN, window + HORIZON
            x, y = seg[:, :, :window], seg[:, :, window:].transpose(1, 2)
            mu, sd = x.mean(-1, keepdim=True), x.std(-1, keepdim=True) + 1e-5
            opt.zero_grad(set_to_none=True)
            pred = model((x - mu) / sd)
            nn.functional.mse_loss(pred, (y - mu.transpose(1, 2)) / sd.transpose(1, 2)).backward()
            opt.step()
    return setup, run, ("temporal conv net forecaster (7 residual blocks of weight-normed causal dilated Conv1d, "
                        "dilations 1-64, 64 channels, dropout) on windows gathered from a 21-variable series, "
                        "per-window normalization, 24-step horizon, MSE, Adam; batch x window 32x512, 64x256, "
                        "16x1024, 48x384")


def _fpn_retina_eval_varsize():
    import torch
    from torch import nn

    A, NCLS = 9, 20

    def cbr(i, o, s):
        return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

    class RetinaLike(nn.Module):
        def __init__(self, f=96):
            super().__init__()
            self.stem = nn.Sequential(cbr(3, 32, 2), cbr(32, 32, 2))                    # /4
            self.c3 = nn.Sequential(cbr(32, 64, 2), cbr(64, 64, 1))                    # /8
            self.c4 = nn.Sequential(cbr(64, 128, 2), cbr(128, 128, 1))                 # /16
            self.c5 = nn.Sequential(cbr(128, 256, 2), cbr(256, 256, 1))                # /32
            self.lat = nn.ModuleList(nn.Conv2d(c, f, 1) for c in (64, 128, 256))
            self.smooth = nn.ModuleList(nn.Conv2d(f, f, 3, 1, 1) for _ in range(3))
            self.p6, self.p7 = nn.Conv2d(256, f, 3, 2, 1), nn.Conv2d(f, f, 3, 2, 1)
            tower = lambda: nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(f, f, 3, 1, 1), nn.ReLU())])
            self.cls_tower, self.box_tower = tower(), tower()
            self.cls, self.box = nn.Conv2d(f, A * NCLS, 3, 1, 1), nn.Conv2d(f, A * 4, 3, 1, 1)

        def forward(self, x):
            c3 = self.c3(self.stem(x))
            c4 = self.c4(c3)
            c5 = self.c5(c4)
            p5 = self.lat[2](c5)
            p4 = self.lat[1](c4) + nn.functional.interpolate(p5, size=c4.shape[-2:], mode="nearest")
            p3 = self.lat[0](c3) + nn.functional.interpolate(p4, size=c3.shape[-2:], mode="nearest")
            p6 = self.p6(c5)
            feats = [self.smooth[0](p3), self.smooth[1](p4), self.smooth[2](p5), p6, self.p7(torch.relu(p6))]
            b = x.shape[0]
            scores = [self.cls(self.cls_tower(p)).permute(0, 2, 3, 1).reshape(b, -1, NCLS) for p in feats]
            deltas = [self.box(self.box_tower(p)).permute(0, 2, 3, 1).reshape(b, -1, 4) for p in feats]
            return scores, deltas

    def setup():
        return RetinaLike().eval()

    def run(model):
        g = torch.Generator().manual_seed(22)
        with torch.no_grad():
            for _ in range(4):
                h, w = (int(v) * 32 for v in torch.randint(8, 21, (2,), generator=g))  # 256..640, /32
                batch = int(torch.randint(1, 4, (1,), generator=g))
                scores, deltas = model(torch.randn(batch, 3, h, w))
                kept = []
                for s, d in zip(scores, deltas):                        # per level: top-1000 anchors by score
                    prob = s.sigmoid().flatten(1)
                    top, idx = prob.topk(min(1000, prob.shape[1]), 1)
                    anchor = idx // NCLS
                    boxes = torch.gather(d, 1, anchor[..., None].expand(-1, -1, 4))
                    kept.append(torch.cat([boxes, top[..., None], (idx % NCLS)[..., None].float()], -1))
                dets = torch.cat(kept, 1)
                order = dets[..., 4].argsort(1, descending=True)[:, :100]
                _ = torch.gather(dets, 1, order[..., None].expand(-1, -1, 6))
                del scores, deltas, kept, dets
    return setup, run, ("RetinaNet-like detector eval under no_grad: small conv backbone, FPN (1x1 laterals, nearest "
                        "top-down adds, 3x3 smoothing, P6/P7), shared 3-conv class/box towers over 5 levels, 9 "
                        "anchors x 20 classes, per-level sigmoid top-1000, merged top-100; 4 batches of 1-3 images "
                        "at random sizes 256-640 (multiples of 32)")


# -- fifth batch (recorded 2026-12-06 by helper r66f as a fresh held-out set, only measured) --

def _whisper_like_asr_train():
    import math
    import torch
    from torch import nn

    V, D, H, PAD = 4000, 192, 4, -100

    def sinusoids(t, d):
        inv = torch.exp(-math.log(10000) * torch.arange(0, d, 2) / d)
        ang = torch.arange(t)[:, None] * inv[None]
        return torch.cat([ang.sin(), ang.cos()], 1)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

        def forward(self, x, mem=None, causal=False):
            b, t, _ = x.shape
            src = x if mem is None else mem
            q = self.q(x).view(b, t, H, -1).transpose(1, 2)
            k, v = self.kv(src).view(b, src.shape[1], 2, H, -1).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return self.o(a.transpose(1, 2).reshape(b, t, D))

    class EncLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.att, self.ln2 = nn.LayerNorm(D), Attn(), nn.LayerNorm(D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x):
            x = x + self.att(self.ln1(x))
            return x + self.ff(self.ln2(x))

    class DecLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.self_att = nn.LayerNorm(D), Attn()
            self.ln2, self.cross = nn.LayerNorm(D), Attn()
            self.ln3 = nn.LayerNorm(D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x, mem):
            x = x + self.self_att(self.ln1(x), causal=True)
            x = x + self.cross(self.ln2(x), mem)
            return x + self.ff(self.ln3(x))

    class Whisper(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv1d(80, D, 3, padding=1)
            self.conv2 = nn.Conv1d(D, D, 3, stride=2, padding=1)
            self.enc = nn.ModuleList(EncLayer() for _ in range(3))
            self.enc_ln = nn.LayerNorm(D)
            self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(256, D)
            self.dec = nn.ModuleList(DecLayer() for _ in range(3))
            self.dec_ln = nn.LayerNorm(D)

        def forward(self, mel, tokens):
            x = nn.functional.gelu(self.conv2(nn.functional.gelu(self.conv1(mel)))).transpose(1, 2)
            x = x + sinusoids(x.shape[1], D)
            for lyr in self.enc:
                x = lyr(x)
            mem = self.enc_ln(x)
            y = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for lyr in self.dec:
                y = lyr(y, mem)
            return self.dec_ln(y) @ self.tok.weight.t()                 # tied output projection

    def setup():
        model = Whisper()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(31)
        for batch, frames, max_tok in ((6, 1000, 48), (4, 1500, 80), (8, 600, 32), (5, 1200, 64)):
            mel = torch.randn(batch, 80, frames, generator=g).log_softmax(1)   # log-mel stand-in
            lens = torch.randint(max_tok // 3, max_tok + 1, (batch,), generator=g)
            t = int(lens.max())
            toks = torch.randint(1, V, (batch, t + 1), generator=g)
            keep = torch.arange(t + 1)[None] <= lens[:, None]
            inp = toks[:, :-1].masked_fill(~keep[:, :-1], 0)
            tgt = toks[:, 1:].masked_fill(~keep[:, 1:], PAD)
            opt.zero_grad(set_to_none=True)
            logits = model(mel, inp)
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), ignore_index=PAD)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return setup, run, ("Whisper-like ASR encoder-decoder (Conv1d stem with stride 2 over 80 log-mel bins, 3 "
                        "pre-norm encoder + 3 decoder layers with causal self- and cross-attention, d=192, tied "
                        "embedding vocab 4000), padded targets, clip_grad_norm_, AdamW; batch x frames x max "
                        "tokens 6x1000x48, 4x1500x80, 8x600x32, 5x1200x64")


def _two_tower_inbatch_train():
    import torch
    from torch import nn

    U, I, C, D = 60_000, 150_000, 500, 64

    class UserTower(nn.Module):
        def __init__(self, item_table):
            super().__init__()
            self.uid = nn.Embedding(U, D)
            self.items = item_table
            self.mlp = nn.Sequential(nn.Linear(3 * D, 256), nn.ReLU(), nn.Linear(256, D))

        def forward(self, uid, hist, hist_off, recent):
            h = nn.functional.embedding_bag(hist, self.items.weight, hist_off, mode="mean")
            r = self.items(recent).mean(1)                              # last 5 items, averaged
            return self.mlp(torch.cat([self.uid(uid), h, r], 1))

    class ItemTower(nn.Module):
        def __init__(self, item_table):
            super().__init__()
            self.items, self.cat = item_table, nn.Embedding(C, 16)
            self.mlp = nn.Sequential(nn.Linear(D + 16 + 8, 256), nn.ReLU(), nn.Linear(256, D))

        def forward(self, iid, cat, feats):
            return self.mlp(torch.cat([self.items(iid), self.cat(cat), feats], 1))

    def setup():
        items = nn.Embedding(I, D)
        user, item = UserTower(items), ItemTower(items)
        params = list({id(p): p for p in list(user.parameters()) + list(item.parameters())}.values())
        return user, item, torch.optim.Adagrad(params, lr=0.05)

    def run(state):
        user, item, opt = state
        g = torch.Generator().manual_seed(32)
        logq_table = torch.log(torch.rand(I, generator=g) * 1e-4 + 1e-6)   # sampling-probability estimate
        for batch, hist_len in ((1024, 30), (4096, 10), (2048, 50), (512, 80)):
            uid = torch.randint(0, U, (batch,), generator=g)
            lens = torch.randint(1, 2 * hist_len, (batch,), generator=g)
            off = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
            hist = torch.randint(0, I, (int(lens.sum()),), generator=g)
            recent = torch.randint(0, I, (batch, 5), generator=g)
            iid = torch.randint(0, I, (batch,), generator=g)
            cat, feats = torch.randint(0, C, (batch,), generator=g), torch.randn(batch, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            u = nn.functional.normalize(user(uid, hist, off, recent), dim=1)
            v = nn.functional.normalize(item(iid, cat, feats), dim=1)
            logits = u @ v.t() / 0.05 - logq_table[iid][None, :]        # in-batch negatives, logQ correction
            loss = nn.functional.cross_entropy(logits, torch.arange(batch))
            loss.backward()
            opt.step()
    return setup, run, ("two-tower retrieval model (user tower: id embedding 60k + mean EmbeddingBag over history "
                        "and last-5 items from a shared 150k x 64 item table + MLP; item tower: shared table + "
                        "category + dense features + MLP), normalized dot products, batch x batch in-batch "
                        "softmax with logQ correction, Adagrad (dense); batch x history 1024x30, 4096x10, "
                        "2048x50, 512x80")


def _speculative_decode():
    import torch
    from torch import nn

    V = 6000

    def decoder(d, heads, layers):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
                self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

            def forward(self, x, cache):
                b, t, _ = x.shape
                q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
                past = cache.get("k")
                if past is not None:
                    k, v = torch.cat([past, k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
                s = k.shape[2]
                mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)   # causal over the new tokens
                a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
                return x + self.ff(self.ln2(x))

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(1024, d)
                self.blocks = nn.ModuleList(Block() for _ in range(layers))
                self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

            def forward(self, idx, caches, start):
                x = self.tok(idx) + self.pos(torch.arange(start, start + idx.shape[1]))
                for blk, c in zip(self.blocks, caches):
                    x = blk(x, c)
                return self.head(self.ln(x))
        return LM().eval()

    def crop(caches, n):                                                # drop rejected positions (views)
        for c in caches:
            c["k"], c["v"] = c["k"][:, :, :n], c["v"][:, :, :n]

    def setup():
        return decoder(384, 6, 4), decoder(128, 4, 1)

    def run(state):
        target, draft = state
        g = torch.Generator().manual_seed(33)
        gamma = 4
        with torch.no_grad():
            for batch, prompt, new in ((4, 96, 28), (2, 200, 20), (6, 40, 20)):
                tc, dc = [dict() for _ in target.blocks], [dict() for _ in draft.blocks]
                seq = torch.randint(0, V, (batch, prompt), generator=g)
                tlog = target(seq[:, :-1], tc, 0)                        # prefill both, last token pending
                draft(seq[:, :-1], dc, 0)
                del tlog
                while seq.shape[1] < prompt + new:
                    n = seq.shape[1]
                    last, qs, props = seq[:, -1:], [], []
                    for j in range(gamma):                              # draft proposes gamma tokens
                        q = draft(last, dc, n - 1 + j)[:, -1].softmax(-1)
                        last = torch.multinomial(q, 1, generator=g)
                        qs.append(q)
                        props.append(last)
                    prop = torch.cat(props, 1)
                    p = target(torch.cat([seq[:, -1:], prop], 1), tc, n - 1).softmax(-1)   # b, gamma+1, V
                    q = torch.stack(qs, 1)
                    pt = p[:, :gamma].gather(2, prop[..., None])[..., 0]
                    qt = q.gather(2, prop[..., None])[..., 0]
                    ok = torch.rand(batch, gamma, generator=g) < (pt / qt).clamp(max=1)
                    acc = int(ok.cumprod(1).sum(1).min())                # accept the common prefix
                    if acc < gamma:                                      # resample from the residual
                        resid = (p[:, acc] - q[:, acc]).clamp(min=0) + 1e-9
                        fix = torch.multinomial(resid / resid.sum(-1, keepdim=True), 1, generator=g)
                    else:
                        fix = torch.multinomial(p[:, gamma], 1, generator=g)
                    seq = torch.cat([seq, prop[:, :acc], fix], 1)
                    crop(tc, n + acc)
                    crop(dc, n + acc)
                    del p, q, qs, props, prop, pt, qt, ok
                del tc, dc, seq
    return setup, run, ("speculative decoding under no_grad: 1-layer d=128 draft proposes 4 sampled tokens, 4-layer "
                        "d=384 target (vocab 6000) verifies them in one forward with a masked KV cache grown by "
                        "torch.cat, rejection sampling with residual resample, both caches cropped by slicing; "
                        "batch x prompt x new tokens 4x96x28, 2x200x20, 6x40x20")


def _pointnet_seg_varpoints_train():
    import torch
    from torch import nn

    def mlp(chs):
        layers = []
        for i, o in zip(chs, chs[1:]):
            layers += [nn.Conv1d(i, o, 1), nn.BatchNorm1d(o), nn.ReLU()]
        return nn.Sequential(*layers)

    class TNet(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.feat = mlp([k, 64, 128, 512])
            self.fc = nn.Sequential(nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))

        def forward(self, x):
            m = self.fc(self.feat(x).amax(2)).view(-1, self.k, self.k)
            return m + torch.eye(self.k)

    class PointNetSeg(nn.Module):
        def __init__(self, parts=16):
            super().__init__()
            self.t3, self.t64 = TNet(3), TNet(64)
            self.f1, self.f2 = mlp([3, 64, 64]), mlp([64, 128, 1024])
            self.head = nn.Sequential(mlp([1088, 512, 256, 128]), nn.Conv1d(128, parts, 1))

        def forward(self, pts):                                         # b, 3, N
            x = torch.bmm(self.t3(pts).transpose(1, 2), pts)
            x = self.f1(x)
            t = self.t64(x)
            local = torch.bmm(t.transpose(1, 2), x)
            glob = self.f2(local).amax(2, keepdim=True)
            out = self.head(torch.cat([local, glob.expand(-1, -1, local.shape[2])], 1))
            return out, t

    def setup():
        model = PointNetSeg()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(34)
        for batch, n in ((8, 1024), (5, 2048), (12, 512), (4, 1536)):
            pts = torch.randn(batch, 3, n, generator=g)
            labels = torch.randint(0, 16, (batch, n), generator=g)
            opt.zero_grad(set_to_none=True)
            out, t = model(pts)
            reg = (t @ t.transpose(1, 2) - torch.eye(64)).square().sum((1, 2)).mean()
            loss = nn.functional.cross_entropy(out, labels) + 1e-3 * reg
            loss.backward()
            opt.step()
    return setup, run, ("PointNet part segmentation (input 3x3 and feature 64x64 T-Nets, Conv1d shared MLPs to 1024, "
                        "max-pooled global feature concatenated per point, BatchNorm1d, orthogonality "
                        "regularizer), Adam; batch x points 8x1024, 5x2048, 12x512, 4x1536")


def _vae_decoder_eval_multires():
    import torch
    from torch import nn

    class Res(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(32, i), nn.Conv2d(i, o, 3, padding=1)
            self.n2, self.c2 = nn.GroupNorm(32, o), nn.Conv2d(o, o, 3, padding=1)
            self.skip = nn.Conv2d(i, o, 1) if i != o else nn.Identity()

        def forward(self, x):
            h = self.c1(nn.functional.silu(self.n1(x)))
            return self.skip(x) + self.c2(nn.functional.silu(self.n2(h)))

    class MidAttn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.qkv, self.o = nn.GroupNorm(32, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

        def forward(self, x):
            b, c, h, w = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(b, 3, 1, c, h * w).transpose(-1, -2).unbind(1)
            a = nn.functional.scaled_dot_product_attention(q, k, v)     # one head over h*w tokens
            return x + self.o(a.transpose(-1, -2).reshape(b, c, h, w))

    class Decoder(nn.Module):
        def __init__(self, ch=(128, 128, 64, 32)):
            super().__init__()
            self.post_quant = nn.Conv2d(4, 4, 1)
            self.conv_in = nn.Conv2d(4, ch[0], 3, padding=1)
            self.mid = nn.Sequential(Res(ch[0], ch[0]), MidAttn(ch[0]), Res(ch[0], ch[0]))
            ups = []
            for i in range(len(ch)):
                o = ch[i]
                prev = ch[max(i - 1, 0)]
                blocks = [Res(prev, o), Res(o, o)]
                if i < len(ch) - 1:
                    blocks += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(o, o, 3, padding=1)]
                ups.append(nn.Sequential(*blocks))
            self.up = nn.Sequential(*ups)
            self.out = nn.Sequential(nn.GroupNorm(32, ch[-1]), nn.SiLU(), nn.Conv2d(ch[-1], 3, 3, padding=1))

        def forward(self, z):
            x = self.conv_in(self.post_quant(z / 0.18215))
            return self.out(self.up(self.mid(x)))

    def setup():
        return Decoder().eval()

    def run(model):
        g = torch.Generator().manual_seed(35)
        with torch.inference_mode():
            for batch, h, w in ((2, 16, 16), (1, 24, 32), (1, 32, 32), (3, 12, 20), (2, 20, 24)):
                z = torch.randn(batch, 4, h, w, generator=g)
                img = model(z)
                img = ((img.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
                del z, img
    return setup, run, ("Stable-Diffusion-like VAE decoder eval under inference_mode (4-ch latent, mid ResBlocks + "
                        "single-head spatial self-attention, 4 up stages 128-128-64-32 with GroupNorm/SiLU and "
                        "nearest x2 upsampling, uint8 HWC output); batch x latent 2x16x16, 1x24x32, 1x32x32, "
                        "3x12x20, 2x20x24 (images 8x larger)")


def _gpt_lora_accum_finetune():
    import torch
    from torch import nn

    V, D, H, L, R, PAD = 5000, 256, 8, 4, 8, -100

    class LoRALinear(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.base = nn.Linear(i, o)
            self.base.requires_grad_(False)
            self.a = nn.Parameter(torch.randn(R, i) * 0.01)
            self.b = nn.Parameter(torch.zeros(o, R))

        def forward(self, x):
            return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.a), self.b) * 2.0

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.o = LoRALinear(D, 3 * D), LoRALinear(D, D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x, mask):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, D))
            return x + self.ff(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(512, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln = nn.LayerNorm(D)

        def forward(self, ids, pad_mask):
            t = ids.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & pad_mask[:, None, None, :]
            x = self.tok(ids) + self.pos(torch.arange(t))
            for blk in self.blocks:
                x = blk(x, mask)
            return self.ln(x) @ self.tok.weight.t()

    def setup():
        model = GPT()
        for n, p in model.named_parameters():
            if not n.endswith((".a", ".b")):
                p.requires_grad_(False)
        model.train()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(36)
        for micro in ((6, 4, 5), (3, 6), (6, 2, 5, 4)):               # uneven micro-batches per step
            opt.zero_grad(set_to_none=True)
            total = sum(micro)
            for b in micro:
                lens = torch.randint(16, 257, (b,), generator=g)
                t = int(lens.max())                                     # pad to this micro-batch's longest
                ids = torch.randint(1, V, (b, t), generator=g)
                keep = torch.arange(t)[None] < lens[:, None]
                ids = ids.masked_fill(~keep, 0)
                labels = ids[:, 1:].masked_fill(~keep[:, 1:], PAD)
                logits = model(ids, keep)[:, :-1]
                loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=PAD)
                (loss * b / total).backward()
                del logits, loss
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
    return setup, run, ("GPT-like 4-layer d=256 (vocab 5000, tied head) LoRA fine-tune: frozen base, rank-8 "
                        "adapters on qkv and output projections, attention dropout, causal + padding bool mask, "
                        "gradient accumulation over uneven micro-batches (6+4+5, 3+6, 6+2+5+4) each padded "
                        "to its longest of lengths in [16, 256], clip_grad_norm_, AdamW")


def _perceiver_io_mlm_train():
    import torch
    from torch import nn

    V, D, NL, DL = 262, 128, 96, 256                                    # bytes + specials, d, latents, latent d

    class XAttn(nn.Module):
        def __init__(self, dq, dkv, out):
            super().__init__()
            self.lnq, self.lnkv = nn.LayerNorm(dq), nn.LayerNorm(dkv)
            self.q, self.kv, self.o = nn.Linear(dq, out), nn.Linear(dkv, 2 * out), nn.Linear(out, out)
            self.heads = 4

        def forward(self, xq, xkv, mask=None):
            b, tq, _ = xq.shape
            tk = xkv.shape[1]
            q = self.q(self.lnq(xq)).view(b, tq, self.heads, -1).transpose(1, 2)
            k, v = self.kv(self.lnkv(xkv)).view(b, tk, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.o(a.transpose(1, 2).reshape(b, tq, -1))

    class Perceiver(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(4096, D)
            self.latents = nn.Parameter(torch.randn(NL, DL) * 0.02)
            self.encode = XAttn(DL, D, DL)
            self.self_layers = nn.ModuleList(
                nn.TransformerEncoderLayer(DL, 8, 2 * DL, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(4))
            self.decode = XAttn(D, DL, D)
            self.out = nn.Linear(D, V)

        def forward(self, ids, pad):                                    # pad: b, T (True = real byte)
            b, t = ids.shape
            pos = self.pos(torch.arange(t))
            x = self.emb(ids) + pos
            lat = self.latents.expand(b, -1, -1)
            lat = lat + self.encode(lat, x, pad[:, None, None, :])
            for lyr in self.self_layers:
                lat = lyr(lat)
            q = pos.expand(b, -1, -1)                                   # output queries: positions
            return self.out(q + self.decode(q, lat))

    def setup():
        model = Perceiver()
        return model, torch.optim.Adam(model.parameters(), lr=3e-4)

    def run(state):
        model, opt = state
        g = torch.Generator().manual_seed(37)
        for batch, maxlen in ((8, 2048), (4, 4096), (12, 1024), (6, 3000)):
            lens = torch.randint(maxlen // 4, maxlen + 1, (batch,), generator=g)
            t = int(lens.max())
            pad = torch.arange(t)[None] < lens[:, None]
            ids = torch.randint(6, V, (batch, t), generator=g).masked_fill(~pad, 0)
            masked = (torch.rand(batch, t, generator=g) < 0.15) & pad
            labels = ids.masked_fill(~masked, -100)
            inp = ids.masked_fill(masked, 3)                            # [MASK]
            opt.zero_grad(set_to_none=True)
            logits = model(inp, pad)
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
            loss.backward()
            opt.step()
    return setup, run, ("Perceiver IO byte-level masked LM: 96 learned latents (d=256) cross-attend to padded byte "
                        "inputs (d=128, key padding mask), 4 latent self-attention layers, decoder cross-attention "
                        "with positional output queries to 262-way logits per byte, Adam; batch x max bytes "
                        "8x2048, 4x4096, 12x1024, 6x3000 (lengths varying within each batch)")


def _yolo_multiscale_ema_train():
    import copy
    import torch
    from torch import nn

    NC, NA = 10, 3

    def cbs(i, o, k=3, s=1):
        return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o), nn.SiLU(inplace=True))

    class CSP(nn.Module):
        def __init__(self, c, n):
            super().__init__()
            h = c // 2
            self.a, self.b = cbs(c, h, 1), cbs(c, h, 1)
            self.m = nn.Sequential(*(nn.Sequential(cbs(h, h, 1), cbs(h, h, 3)) for _ in range(n)))
            self.out = cbs(2 * h, c, 1)

        def forward(self, x):
            return self.out(torch.cat([self.m(self.a(x)), self.b(x)], 1))

    class Yolo(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = cbs(3, 16, 3, 2)
            self.s2 = nn.Sequential(cbs(16, 32, 3, 2), CSP(32, 1))
            self.s3 = nn.Sequential(cbs(32, 64, 3, 2), CSP(64, 2))          # stride 8
            self.s4 = nn.Sequential(cbs(64, 128, 3, 2), CSP(128, 2))        # stride 16
            self.s5 = nn.Sequential(cbs(128, 256, 3, 2), CSP(256, 1))       # stride 32
            self.lat5, self.lat4 = cbs(256, 128, 1), cbs(128, 64, 1)
            self.td4, self.td3 = CSP(256, 1), CSP(128, 1)
            self.td4r = cbs(256, 128, 1)
            self.heads = nn.ModuleList(nn.Conv2d(c, NA * (5 + NC), 1) for c in (128, 128, 256))

        def forward(self, x):
            c3 = self.s3(self.s2(self.stem(x)))
            c4 = self.s4(c3)
            c5 = self.s5(c4)
            p5 = self.lat5(c5)
            p4 = self.td4r(self.td4(torch.cat([nn.functional.interpolate(p5, scale_factor=2.0), c4], 1)))
            p3 = self.td3(torch.cat([nn.functional.interpolate(self.lat4(p4), scale_factor=2.0), c3], 1))
            outs = []
            for head, p in zip(self.heads, (p3, p4, c5)):
                b, _, h, w = p.shape
                outs.append(head(p).view(b, NA, 5 + NC, h, w).permute(0, 1, 3, 4, 2))
            return outs

    def setup():
        model = Yolo()
        ema = copy.deepcopy(model).eval()
        for p in ema.parameters():
            p.requires_grad_(False)
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (no_decay if p.ndim == 1 else decay).append(p)
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay}],
                              lr=0.01, momentum=0.937, nesterov=True)
        return model, ema, opt

    def run(state):
        model, ema, opt = state
        g = torch.Generator().manual_seed(38)
        for batch, size in ((8, 256), (8, 352), (8, 192), (8, 320), (8, 224)):   # multi-scale: new size a step
            imgs = torch.rand(batch, 3, size, size, generator=g)
            opt.zero_grad(set_to_none=True)
            preds = model(imgs)
            loss = imgs.new_zeros(())
            for p in preds:
                obj_t = (torch.rand(p.shape[:4], generator=g) < 0.02).float()     # assigned anchors
                loss = loss + nn.functional.binary_cross_entropy_with_logits(p[..., 4], obj_t)
                pos = obj_t.bool()
                if pos.any():
                    pp = p[pos]                                                   # n, 5 + NC
                    box_t = torch.rand(pp.shape[0], 4, generator=g)
                    cls_t = nn.functional.one_hot(torch.randint(0, NC, (pp.shape[0],), generator=g), NC).float()
                    loss = loss + (pp[:, :4].sigmoid() - box_t).abs().mean()
                    loss = loss + nn.functional.binary_cross_entropy_with_logits(pp[:, 5:], cls_t)
            (loss * batch).backward()
            opt.step()
            with torch.no_grad():                                                 # EMA of weights and buffers
                msd = model.state_dict()
                for k, v in ema.state_dict().items():
                    if v.dtype.is_floating_point:
                        v.mul_(0.999).add_(msd[k].detach(), alpha=0.001)
    return setup, run, ("YOLO-like detector training (CSP conv-BN-SiLU backbone, FPN top-down path, 3 heads at "
                        "strides 8/16/32, 3 anchors x 10 classes), multi-scale: batch 8 at 256, 352, 192, 320, "
                        "224 px, objectness BCE + L1 box + class BCE on randomly assigned anchors, SGD nesterov "
                        "with decay groups, EMA model updated each step")


WORKLOADS: Dict[str, Callable] = {
    "vit_train_varbatch": _vit_train_varbatch,
    "gru_seq2seq_train": _gru_seq2seq_train,
    "unet_diffusion_train": _unet_diffusion_train,
    "beam_search_decode": _beam_search_decode,
    "moe_train": _moe_train,
    "gnn_scatter_train": _gnn_scatter_train,
    "wide_deep_inference": _wide_deep_inference,
    # second batch
    "t5_style_encdec_train": _t5_style_encdec_train,
    "conv_vae_train": _conv_vae_train,
    "speech_conformer_like": _speech_conformer_like,
    "detr_like_eval": _detr_like_eval,
    "llama_style_prefill_decode": _llama_style_prefill_decode,
    "graph_attention_train": _graph_attention_train,
    "mixed_precision_like_train": _mixed_precision_like_train,
    # third batch
    "swin_like_train": _swin_like_train,
    "nn_transformer_translate_train": _nn_transformer_translate_train,
    "wavenet_like_train": _wavenet_like_train,
    "dlrm_like_train": _dlrm_like_train,
    "ppo_rollout_train": _ppo_rollout_train,
    "ssm_scan_train": _ssm_scan_train,
    "mobilenet_eval_varsize": _mobilenet_eval_varsize,
    "gan_train": _gan_train,
    # fourth batch
    "resnet_sgd_train_varbatch": _resnet_sgd_train_varbatch,
    "bert_infer_dynamic_padding": _bert_infer_dynamic_padding,
    "lstm_tbptt_train": _lstm_tbptt_train,
    "diffusion_cfg_sampler": _diffusion_cfg_sampler,
    "clip_contrastive_train": _clip_contrastive_train,
    "convnext_grad_accum_train": _convnext_grad_accum_train,
    "tcn_forecast_train": _tcn_forecast_train,
    "fpn_retina_eval_varsize": _fpn_retina_eval_varsize,
    # fifth batch
    "whisper_like_asr_train": _whisper_like_asr_train,
    "two_tower_inbatch_train": _two_tower_inbatch_train,
    "speculative_decode": _speculative_decode,
    "pointnet_seg_varpoints_train": _pointnet_seg_varpoints_train,
    "vae_decoder_eval_multires": _vae_decoder_eval_multires,
    "gpt_lora_accum_finetune": _gpt_lora_accum_finetune,
    "perceiver_io_mlm_train": _perceiver_io_mlm_train,
    "yolo_multiscale_ema_train": _yolo_multiscale_ema_train,
}
